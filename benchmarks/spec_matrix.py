#!/usr/bin/env python
"""Speculation matrix: k = 0..4 draft tokens (and "auto") x concurrency 1, 8, 32, 128 through the engine.

    python benchmarks/spec_matrix.py                           # the embedded default model, GPU if any
    python benchmarks/spec_matrix.py --ks 0,1,2,3,4,auto --workload random --temperature 1
    python benchmarks/spec_matrix.py --tiny --device cpu --ks 0,1,auto   # the adaptive row, a smoke run
    python benchmarks/spec_matrix.py --model DIR --prompts prompts.jsonl --temperature 0.7
    python benchmarks/spec_matrix.py --tiny --device cpu       # a tiny code model trained now, seconds
    python benchmarks/spec_matrix.py --grpc localhost:50051    # a running server, through the gRPC API
    python benchmarks/spec_matrix.py --http localhost:8080     # a running server, through the OpenAI HTTP API

By default this measures the in-process engine: one LLMEngine (the object LLM wraps) is built here
and its step() is driven by this script, which timestamps every token when step() hands it back; no
server, network or client is in those numbers. With --grpc HOST:PORT it measures a running server
(`mtpserve serve ...`) through mtpserve.cluster.client.AsyncClient instead, timestamping each
streamed chunk on arrival; the server's own engine settings (max_num_seqs, device, ...) then apply,
and the per-position acc@j columns stay empty (the API reports accepted drafts and verify steps per
request, not per position; AL is computed from those). --http HOST:PORT does the same through the
OpenAI-compatible HTTP API (`mtpserve serve --http-port`) with the official `openai` client, streaming
/v1/completions (server-sent events).

For each concurrency C, a closed loop keeps C requests in flight (a finished request is replaced by
the next one at once) until max(--min-requests, --requests-per-slot * C) requests have finished;
every request generates --max-tokens tokens (eos ignored) from a held-out stdlib function prompt
(as in acceptance.py) or --prompts FILE; --workload random sends prompts of --random-prompt-len random
token ids instead (little to predict: low acceptance). k is set per request
(SamplingParams.num_speculative_tokens) on one engine, so every cell runs on the same weights and KV
pool; `auto` lets the engine choose each step's k (docs/design.md §9). The engine's adaptive state
(step costs per batch bucket and k, the engine-wide acceptance prior) learns from every step it runs,
the fixed-k cells' and the warm-up's included, as a serving engine learns from all its traffic.

Columns, the table form of DeepSeek's MTP0..MTP4 reports:
  out tok/s   generated tokens / wall time of the cell
  TTFT        submission -> first token, per request (ms, p50 / p99)
  TPOT        (last token time - first token time) / (tokens - 1), per request (ms, p50 / p99)
  AL          acceptance length, 1 + accepted drafts / verify steps (k = 0: 1)
  acc@j       fraction of verify steps whose draft j was accepted
  speedup     out tok/s against k = 0 at the same concurrency
  vs best     out tok/s against the best fixed k at the same concurrency (auto's target: >= 0.98)
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import host  # noqa: E402
import workloads  # noqa: E402
from server_targets import Driver, Target, grpc_target, http_target  # noqa: E402
from common import Table, check, percentile  # noqa: E402

import torch  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.cluster.spec_rate import expected_tokens  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_matrix_args(p)
    p.add_argument("--grpc", default=None, metavar="HOST:PORT", help="measure a running server instead")
    p.add_argument("--http", default=None, metavar="HOST:PORT", help="measure a running server's OpenAI HTTP API")
    p.add_argument("--token", default=None, help="bearer token for --grpc/--http (default: $MTPSERVE_AUTH_TOKEN)")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency="1,4", max_tokens=16, min_requests=4)
    return args


def add_matrix_args(p: argparse.ArgumentParser) -> None:
    """The matrix's own flags: which cells, which workload, which engine (cell_phases.py shares them)."""
    common.add_common_args(p)
    common.add_model_prompt_args(p)
    host.add_pin_arg(p)
    p.add_argument("--steady-host", type=float, default=0.15,
                   help="where the driving thread is pinned, run a round again when its host probes spread by more "
                        "than this fraction (max / min - 1)")
    # Off by default: on the H100 machine (run 214) a core's probe moved by up to 75 % inside most rounds even
    # pinned to the fastest core, so at 15 % nearly every round ran again, a matrix took up to four times as long
    # and was no steadier for it.
    p.add_argument("--steady-retries", type=int, default=0, help="... at most this many times a round (0: never)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for the whole run: each concurrency gets an equal share of what is left when it "
                        "starts, and runs its first round and every further one its last round says will fit (a run "
                        "cut by an outer timeout writes no section)")
    p.add_argument("--prompt-lines", type=int, default=2)
    p.add_argument("--ks", default="0,1,2,3,4", help="draft counts, comma-separated; 'auto' adds the adaptive row")
    p.add_argument("--workload", choices=("text", "random"), default="text",
                   help="text: --prompts; random: prompts of random token ids (low acceptance)")
    p.add_argument("--random-prompt-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests per cell = this x concurrency ...")
    p.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured runs per cell, the k's in a balanced order (common.balanced_order: a multiple of the "
                        "number of k's balances it fully); the row is the median run (cells of "
                        "one run varied by 10 %% on the H100, more than auto's target allows)")
    p.add_argument("--no-capture-at-start", action="store_true", help="EngineConfig.capture_graphs_at_start=False")
    p.add_argument("--prefill-step-rows", type=int, default=None,
                   help="EngineConfig.prefill_step_rows (default: the engine's; 0: prompts take the general path)")
    p.add_argument("--prefill-hold-steps", type=int, default=None,
                   help="EngineConfig.prefill_hold_steps (default: the engine's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-probe-down", action="store_true",
                   help="diagnosis: auto never probes k - 1 past the MTP modules (the chooser before b8266d6)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    device = common.pick_device(args.device, args.tiny)
    ks, concurrency = common.parse_ks(args.ks), common.parse_ints(args.concurrency)
    fixed = [k for k in ks if k != AUTO]
    max_k = max(fixed, default=0)
    cells = {c: max(args.min_requests, args.requests_per_slot * c) for c in concurrency}
    with tempfile.TemporaryDirectory(prefix="mtpserve-spec-matrix-") as tmp:
        if args.grpc:
            drive, name, close, vocab = grpc_target(args, max_k)
        elif args.http:
            drive, name, close, vocab = http_target(args)
        else:
            drive, name, close, vocab = _engine_target(args, device, Path(tmp), max(concurrency), max_k)
        prompts = matrix_prompts(args, max(cells.values()), vocab)
        server = args.grpc or args.http
        where = f"server {server}" if server else f"device {common.device_name(device)}"
        print(f"model {name}; {where}; requests per cell {cells}")

        def jobs(k: int | str, n: int, max_tokens: int) -> list[workloads.Job]:
            return matrix_jobs(args, prompts, k, n, max_tokens)

        warm_up(drive, jobs, ks, cells, args.max_tokens)
        round_notes = []

        workload = "random-token prompts" if args.workload == "random" else "text prompts"
        table = Table(f"spec matrix: {name}, {workload}, {args.max_tokens} tokens per request, "
                      f"{'greedy' if args.temperature == 0 else f'T={args.temperature:g}'}",
                      ["MTP", "conc", "reqs", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "AL",
                       *[f"acc@{j + 1}" for j in range(max_k)], "speedup", "vs best"])
        summary, paired, noise = [], [], []
        for i, c in enumerate(concurrency):
            now = time.monotonic()
            share = None if deadline is None else now + (deadline - now) / (len(concurrency) - i)
            runs, notes_of_c = measure_rounds(drive, jobs, ks, c, cells[c], args, device, share)
            round_notes += notes_of_c
            rows = {k: _cell(_median_run(runs[k]), k, c, args.max_tokens) for k in ks}
            base = rows[0][0].tokens_per_s if 0 in rows else None
            best = max((rows[k][0].tokens_per_s for k in fixed), default=None)
            for k, (run, cell) in rows.items():
                rates = run.position_rates(max_k if k == AUTO else k)
                rates += [float("nan")] * (max_k - len(rates))
                table.add(f"MTP{k}", str(c), str(cells[c]), *cell, *rates,
                          run.tokens_per_s / base if base else None, run.tokens_per_s / best if best else None)
            if AUTO in rows and best:
                summary.append(f"c={c}: {rows[AUTO][0].tokens_per_s / best:.3f}")
                paired.append(f"c={c}: {_paired_ratios(runs, fixed)}")
                if min(len(r) for r in runs.values()) > 2:
                    spread, excess = _noise([[run.tokens_per_s for run in runs[k]] for k in fixed])
                    noise.append(f"c={c}: runs {spread:.1%}, best-of-{len(fixed)} excess {excess:.1%}")
        close()

    model = f"the server's {name}" if server else args.model or (
        "tiny code model trained by the script" if args.tiny else "default model")
    hold = "the engine's default" if args.prefill_hold_steps is None else args.prefill_hold_steps
    prompts_note = f"{args.random_prompt_len} random token ids" if args.workload == "random" else args.prompts
    notes = [f"model: {model}; "
             f"prompts: {prompts_note}; prefill_hold_steps: {hold}",
             f"gRPC server {args.grpc} (mtpserve.cluster.client), closed loop of `conc` requests in flight"
             if args.grpc else
             f"OpenAI HTTP API of {args.http} (openai client, streaming /v1/completions), closed loop of `conc` "
             "requests in flight" if args.http else
             "in-process engine (LLMEngine.step driven by the script), closed loop of `conc` requests in flight",
             "TTFT/TPOT in ms, from the moment " + ("each streamed chunk arrives (the device line is this client's)"
                                                   if server else "step() returns the tokens")
             + "; percentiles interpolated over requests"]
    if args.repeats > 1:
        up_to = "up to " if args.budget_s is not None else ""
        notes.append(f"each cell: the run of median tok/s of {up_to}{args.repeats}, the k's in a balanced order "
                     "(a Williams design: over as many rounds as k's, each k once in every position and, for an "
                     "even count of k's, once right after every other k)")
    notes += round_notes
    if summary:
        notes.append("auto / best fixed k: " + ", ".join(summary))
    if paired and args.repeats > 1:
        notes.append("auto / best fixed k round by round (the best k by its median, then the median over rounds of "
                     "auto's run / that k's run of the same round): "
                     + ", ".join(paired))
    if noise:
        notes.append("noise (a run's spread across rounds, the median over fixed k of 1.4826 x MAD / median; and the "
                     "expected excess of the best fixed cell over any one of them, were they all equal, which "
                     "auto / best reads as a shortfall): " + ", ".join(noise))
    common.report(args, "spec_matrix", device, [table], notes)
    return 0


AUTO = "auto"


def measure_rounds(drive: "Driver", jobs: Callable[[int | str, int, int], list[workloads.Job]], ks: list[int | str],
                   c: int, n: int, args: argparse.Namespace, device: torch.device, deadline: float | None = None
                   ) -> tuple[dict[int | str, list[workloads.Run]], list[str]]:
    """--repeats rounds of every k's cell of n requests at concurrency c, the k's in a balanced order (no k always runs
    first, nor always after the same k) -> (runs per k, a note per round, with its order and each cell's tok/s).
    Where the driving thread is pinned (pin_driver), each round pins it again and times the host probe
    (benchmarks/host.py) before every cell and after the last; a round whose probes spread by more than
    --steady-host runs again, up to --steady-retries times, so that the cells compared round by round ran at one
    host speed (the H100 machine's cores change speed within a round, session U). The rounds are judged by the
    probe alone, never by their tok/s. Past the first, a round starts only where the last one's time still fits
    before `deadline` (time.monotonic; None: every round runs)."""
    runs: dict[int | str, list[workloads.Run]] = {k: [] for k in ks}
    notes, last = [], 0.0
    for r in range(args.repeats):
        if r and deadline is not None and time.monotonic() + last > deadline:
            notes.append(f"c={c}: {r} of {args.repeats} rounds, the next would not fit --budget-s")
            print(notes[-1], flush=True)
            break
        began, order = time.monotonic(), common.balanced_order(ks, r)
        for attempt in range(args.steady_retries + 1):
            pin, probing = pin_driver(args, device), pinnable(args, device) and args.pin_cpu != "none"
            got, probes = {}, []
            for k in order:
                probes += [host.host_probe()] if probing else []
                got[k] = drive(jobs(k, n, args.max_tokens), c, f"k{k}c{c}r{r}a{attempt}")
            probes += [host.host_probe()] if probing else []
            if not probes or max(probes) <= (1 + args.steady_host) * min(probes):
                break
        spread = f"; host probe {min(probes):.2f}-{max(probes):.2f} ms" if probes else ""
        cells = ", ".join(f"{k} {_rate(got[k])}" for k in order)
        notes.append(f"c={c} round {r}: {pin}{spread}" + (f" (attempt {attempt + 1})" if attempt else "")
                     + f"; in order, tok/s: {cells}")
        print(notes[-1], flush=True)  # as it ends: a run cut short (a timeout) still shows the rounds it made
        for k, run in got.items():
            runs[k].append(run)
        last = time.monotonic() - began
    return runs, notes


def _rate(run: "workloads.Run") -> str:
    rate = getattr(run, "tokens_per_s", None)
    return "-" if rate is None else f"{rate:.0f}"


def pinnable(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether this process's thread drives the engine on a GPU: not for a server (its engine runs in another
    process), nor on the CPU device (the model's threads would inherit the one core)."""
    return device.type == "cuda" and not (getattr(args, "grpc", None) or getattr(args, "http", None))


def pin_driver(args: argparse.Namespace, device: torch.device) -> str:
    """Pin the thread that drives the engine as --pin-cpu says (benchmarks/host.py), chosen again each round:
    the cores' speeds move. Returns a note for the results."""
    if not pinnable(args, device):
        return "driving thread not pinned (a server's engine, or the CPU device, whose model threads need every core)"
    return host.pin_cpu(args.pin_cpu)


def matrix_jobs(args: argparse.Namespace, prompts: list[str] | list[list[int]], k: int | str, n: int,
                max_tokens: int) -> list[workloads.Job]:
    """A cell's n requests: max_tokens each (eos ignored), k drafts (or "auto"), a seed per request."""
    return [workloads.Job(p, SamplingParams(max_tokens=max_tokens, temperature=args.temperature, ignore_eos=True,
                                            num_speculative_tokens=k, seed=args.seed + i))
            for i, p in enumerate(prompts[:n])]


def warm_up(drive: "Driver", jobs: Callable[[int | str, int, int], list[workloads.Job]], ks: list[int | str],
            cells: dict[int, int], max_tokens: int) -> None:
    """Every cell once, not measured, so every prefill shape's Triton specialisation, every (bucket, k) graph
    capture and the allocator's growth happen before the clock runs; then a short pass of each, whose prompts
    now hit the prefix cache as the measured runs' will."""
    for tokens, tag in ((max_tokens, "warm"), (8, "rewarm")):
        for k in ks:
            for c, n in cells.items():
                drive(jobs(k, n, tokens), c, f"{tag}{k}c{c}")


def matrix_prompts(args: argparse.Namespace, n: int, vocab: int | None) -> list[str] | list[list[int]]:
    """--workload text: the prompt source; random: random token ids (seeded), which the model can hardly
    continue predictably, so drafts are mostly rejected."""
    if args.workload == "text":
        return workloads.get_prompts(args.prompts, n, args.prompt_lines)
    check(vocab is not None, "--workload random needs the vocabulary size (not available over --http)")
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.random_prompt_len)] for _ in range(n)]


def _paired_ratios(runs: dict[int | str, list[workloads.Run]], fixed: list[int]) -> str:
    """The median over rounds of auto's tok/s over the best fixed k's in the same round (the best k by median),
    then each round's ratio. The host's speed moves 2x between rounds on the H100 machine (session J, run 77),
    and a ratio of medians taken over different rounds carries that; the cells of one round run one after the
    other. The rounds show whether a shortfall is every round's or one slow round's."""
    best = max(fixed, key=lambda k: _median_run(runs[k]).tokens_per_s)
    ratios = [a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
              for a, b in zip(runs[AUTO], runs[best])]
    return f"{statistics.median(ratios):.3f} (k = {best}; rounds {' '.join(f'{r:.3f}' for r in ratios)})"


def _noise(rates: list[list[float]]) -> tuple[float, float]:
    """rates: per fixed k, its runs' tok/s over the rounds -> (spread, excess). spread: the median over k of a run's
    relative standard deviation (1.4826 x MAD / median); excess: the expected amount by which the best of these
    cells (each the median of its runs, standard deviation about 1.2533 spread / sqrt(runs)) exceeds any one of
    them, were every k equally fast. On the H100 the runs of a cell moved 10-50 % between rounds (session M),
    and with five k's the best cell read about 8 % high: a shortfall of auto below that is no evidence."""
    spreads = [1.4826 * statistics.median(abs(r - statistics.median(runs)) for r in runs) / statistics.median(runs)
               for runs in rates if statistics.median(runs) > 0]
    if not spreads:
        return 0.0, 0.0
    spread, n = statistics.median(spreads), min(len(runs) for runs in rates)
    best_of = np.random.default_rng(0).standard_normal((20000, len(rates))).max(axis=1).mean()  # E[max of k normals]
    return spread, float(best_of * 1.2533 * spread / np.sqrt(n))


def _median_run(runs: list[workloads.Run]) -> workloads.Run:
    """The run of median throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run.tokens_per_s)[(len(runs) - 1) // 2]


def _cell(run: workloads.Run, k: int | str, c: int, max_tokens: int) -> tuple[workloads.Run, list]:
    """Check one measured cell and format its columns up to AL."""
    check(all(len(t.token_ids) == max_tokens for t in run.traces), "every request emits max_tokens")
    check(k in (0, AUTO) or run.spec.num_drafts > 0, f"k = {k} verified no drafts")
    check(k != 0 or run.spec.num_drafts == 0, "k = 0 verified drafts")
    ttft = [t.ttft * 1e3 for t in run.traces]
    tpot = [t.tpot * 1e3 for t in run.traces if t.tpot is not None]
    print(f"MTP{k} c={c}: {run.tokens_per_s:.1f} tok/s, AL {run.spec.acceptance_length:.2f}, {run.wall:.1f} s")
    return run, [f"{run.tokens_per_s:.1f}", percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50),
                 percentile(tpot, 99), run.spec.acceptance_length]


def build_engine(args: argparse.Namespace, device: torch.device, tmp: Path, max_seqs: int, max_k: int,
                 memory_share: float = 1.0) -> LLMEngine:
    """The in-process engine the matrix measures (one for every cell: same weights, same KV pool); memory_share:
    its part of the GPU's memory where several engines share it (interleaved.py)."""
    model = workloads.resolve_model(args.model, args.tiny, tmp)
    hold = {} if args.prefill_hold_steps is None else {"prefill_hold_steps": args.prefill_hold_steps}
    hold["capture_graphs_at_start"] = not args.no_capture_at_start
    if args.prefill_step_rows is not None:
        hold["prefill_step_rows"] = args.prefill_step_rows
    if memory_share < 1.0:
        hold["gpu_memory_utilization"] = EngineConfig.gpu_memory_utilization * memory_share
    engine = LLMEngine(EngineConfig(model=str(model), device=str(device), dtype=args.dtype, max_num_seqs=max_seqs,
                                    seed=args.seed, max_num_batched_tokens=args.max_num_batched_tokens,
                                    **hold))
    check(engine.tokenizer is not None, f"{model} has no tokenizer.json: text prompts cannot be encoded")
    check(engine.model_config.mtp.num_modules > 0 or max_k == 0, f"{model} has no MTP modules")
    if args.no_probe_down and engine.adaptive is not None:  # every draft at one host price, none probed below k
        engine.adaptive.config = replace(engine.adaptive.config, modules=None)
        engine.adaptive.costs.modules = engine.adaptive.config.max_k
    return engine


def _us(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{s * 1e6:.2f}" for s in seconds) + "]"


def describe_auto(engine: LLMEngine, c: int, greedy: bool) -> str:
    """What adaptive speculation now prices a batch of c at: the step cost per k (emitting the tokens the acceptance
    prior expects: priced without tokens, every host-bound k reads alike), its host line and device row, and the
    prior with the strength a request's estimate is pulled toward it by."""
    adaptive = engine.adaptive
    tokens = c * expected_tokens(np.array([adaptive.estimates()]))[0]
    costs, (a, b, _) = adaptive.costs.costs(c, tokens, greedy), adaptive.costs.host_line(c)
    return (f"step cost / k=0 {np.round(costs / costs[0], 2).tolist()} (host now {a * 1e3:.3f} + "
            f"{b * 1e3:.4f}/token ms + {_us(adaptive.costs.host_draft_prices(c))} us a request at k = 0.., "
            f"device {np.round(adaptive.costs.device(c, greedy) * 1e3, 3).tolist()} ms), "
            f"acceptance prior {np.round(adaptive.estimates(), 2).tolist()} at strength "
            f"{adaptive.acceptance.strength:g}")


def _engine_target(args: argparse.Namespace, device: torch.device, tmp: Path, max_seqs: int,
                   max_k: int) -> Target:
    engine = build_engine(args, device, tmp, max_seqs, max_k)

    def drive(jobs: list[workloads.Job], c: int, prefix: str) -> workloads.Run:
        adaptive, runner = engine.adaptive, getattr(engine.executor, "runner", None)
        before = (adaptive.chosen.copy(), runner.num_catch_ups) if adaptive and runner else None
        run = workloads.drive(engine, jobs, c, prefix)
        if before is not None and any(j.params.num_speculative_tokens == AUTO for j in jobs):
            steps = adaptive.chosen - before[0]
            print(f"  auto {prefix}: steps per chosen k {dict(enumerate(steps.tolist()))}, "
                  f"requests caught up {runner.num_catch_ups - before[1]}; "
                  f"{describe_auto(engine, c, jobs[0].params.greedy)}")
        return run

    return drive, engine.resolved.model_path.name, engine.shutdown, engine.model_config.vocab_size


if __name__ == "__main__":
    sys.exit(main())
