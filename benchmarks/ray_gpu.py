#!/usr/bin/env python
"""The Ray path on GPUs: tensor-parallel ranks over NCCL and the drafter group, checked and timed against one GPU.

    python benchmarks/ray_gpu.py --commit SHA --results $OUT/RESULTS.md       # 2 GPUs, ~2-4 min
    python benchmarks/ray_gpu.py --device cpu --max-tokens 8 --concurrency 1  # gloo, a smoke run

Four engines, one after the other (each shut down and its GPU memory freed before the next starts):
  in-process    (a) the engine in this process on one GPU: the reference
  ray tp=1      the same model on one Ray actor (use_ray): what the actor and its control channel cost
  ray tp=2      (b) two target tensor-parallel ranks as Ray actors, one GPU each, all-reducing over NCCL
  ray drafter   (c) one target rank on one GPU, the drafter group (the MTP modules, drafter_devices=1) on
                    the other, drafts crossing over NCCL send/recv
On CPU the same run over gloo. For each engine and each k in --ks, the same greedy prompts (eos ignored,
--max-tokens each) run in one batch, and each request's token ids must equal (a)'s at that k. A mismatch
prints the request, the first differing position and (a)'s top-2 logprob gap there (a gap near 0 is a
near tie that another summation order, e.g. the all-reduce's, may flip; a large one is a bug); the script
goes on and exits 1 at the end. A configuration that fails prints its traceback, the next one still runs,
and the exit status is 1 too; a failed drafter-group run on CUDA is tried once more without CUDA graphs
("ray drafter no graphs"), which tells a graph problem from a transport one. Ray: a local instance with
the GPUs torch sees (or the cluster in RAY_ADDRESS), this checkout on the workers' PYTHONPATH.

Then a closed loop per (engine, k, concurrency) keeps `conc` requests in flight (workloads.drive, as in
spec_matrix.py) for max(--min-requests, 2 x conc) requests, after a short warm-up of the same cell, and
the table gives out tok/s, the ratio to (a) at the same k and concurrency, AL (1 + accepted drafts per
verify step) and whether the cell's tokens equal (a)'s (same schedule, so they should).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import workloads  # noqa: E402
from common import Table, check  # noqa: E402

import torch  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.outputs import RequestOutput  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402
from mtpserve.workers.models.config import ModelConfig  # noqa: E402

REFERENCE = "in-process"
# name -> (EngineConfig overrides, GPUs it needs)
CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    REFERENCE: ({}, 1),
    "ray tp=1": ({"use_ray": True}, 1),
    "ray tp=2": ({"tensor_parallel_size": 2}, 2),
    "ray drafter": ({"drafter_devices": 1}, 2),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.set_defaults(device="cuda")
    p.add_argument("--model", default=None, help="checkpoint dir (default: mtpserve/default_model)")
    p.add_argument("--dtype", default="float32", help="float32 (default) makes greedy equality a fair check")
    p.add_argument("--ks", default="0,3", help="draft counts, comma-separated")
    p.add_argument("--concurrency", default="1,8", help="requests in flight per timed cell, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=8, help="requests per timed cell: max(this, 2 x conc)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"configurations to run, comma-separated, of: {', '.join(CONFIGS)} (the first is the reference)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="EngineConfig.startup_timeout_s: bounds a hung NCCL start or first step, so the "
                        "other configurations still run within the time budget")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, max_tokens=8, concurrency="1")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    return args


@dataclass
class Outcome:
    checked: dict[int, list[RequestOutput]] = field(default_factory=dict)  # k -> the greedy batch's outputs
    runs: dict[tuple[int, int], workloads.Run] = field(default_factory=dict)  # (k, conc) -> timed run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    ks, concurrency = common.parse_ints(args.ks), common.parse_ints(args.concurrency)
    model = workloads.resolve_model(args.model, False, Path("."))
    modules = ModelConfig.from_dir(model).mtp.num_modules
    check(modules > 0 or max(ks) == 0, f"{model} has no MTP modules: use --ks 0")
    cells = {c: max(args.min_requests, 2 * c) for c in concurrency}
    prompts = workloads.get_prompts("stdlib", max(cells.values()), 2)
    skipped = {name: why for name, why in ((n, _skip_reason(n, device, modules)) for n in args.configs) if why}
    queue = [(name, CONFIGS[name][0]) for name in args.configs if name not in skipped]
    for name, why in skipped.items():
        print(f"=== {name}: skipped, {why}")
    outcomes: dict[str, Outcome] = {}
    failed: dict[str, str] = {}
    mismatches: list[str] = []
    started_ray = False
    while queue:
        name, overrides = queue.pop(0)
        print(f"\n=== {name} ({overrides or 'tensor_parallel_size=1, no drafter group'})", flush=True)
        outcomes[name] = Outcome()
        t0 = time.perf_counter()
        try:
            if overrides:  # a Ray configuration: one local Ray instance serves all of them
                started_ray = _start_ray(device) or started_ray
            _run_config(args, device, model, prompts, ks, cells, overrides, outcomes[name])
        except (Exception, SystemExit) as e:  # common.check raises SystemExit; the other configurations still run
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0]}"
            # A failed drafter-group target ran CUDA graphs on a path never run on a GPU before: once more
            # without them tells a graph problem from a transport one (not after a timeout: no time for two).
            if (device.type == "cuda" and overrides and overrides.get("tensor_parallel_size", 1) == 1
                    and "cuda_graphs" not in overrides and time.perf_counter() - t0 < 90):
                queue.insert(0, (f"{name} no graphs", {**overrides, "cuda_graphs": False}))
        _free_memory(device)
        print(f"=== {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if name != REFERENCE and REFERENCE in outcomes:
            mismatches += _compare_outcomes(name, outcomes[REFERENCE], outcomes[name])
    if started_ray:
        import ray

        ray.shutdown()
    notes = _notes(args, device, model, skipped, failed, mismatches)
    common.report(args, "ray_gpu", device, [_table(outcomes, ks, cells)], notes)
    print(f"\nRESULT: {'FAIL' if failed or mismatches else 'OK'}: {len(mismatches)} mismatch(es), "
          f"failed: {sorted(failed) or 'none'}, skipped: {sorted(skipped) or 'none'}")
    return 1 if failed or mismatches else 0


def _skip_reason(name: str, device: torch.device, modules: int) -> str | None:
    overrides, gpus = CONFIGS[name]
    if device.type == "cuda" and torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}"
    if overrides.get("drafter_devices") and modules == 0:
        return "the model has no MTP modules for a drafter group to hold"
    return None


def _start_ray(device: torch.device) -> bool:
    """Start one local Ray instance for both Ray configurations (the executor would start and stop one per
    engine), with exactly the GPUs torch sees; returns whether this script started it."""
    import ray

    if ray.is_initialized():
        return False
    # The workers must import this checkout's mtpserve (on the GPU hosts it is not pip-installed, and a stale
    # installed copy must not win): the raylet, and through it every worker, inherits this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.REPO), os.environ.get("PYTHONPATH")]))
    # A few small all-reduces gain nothing from NVLink multicast, and shared GPU hosts forbid it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if os.environ.get("RAY_ADDRESS"):  # join the cluster named there; it brings its own resources
        ray.init(log_to_driver=True)
        return True
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    for attempt in range(2):  # on a loaded host the raylet sometimes misses Ray's own start-up deadline
        try:
            ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False,
                     log_to_driver=True)
            return True
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    return False


def _run_config(args: argparse.Namespace, device: torch.device, model: Path, prompts: list[str], ks: list[int],
                cells: dict[int, int], overrides: dict[str, Any], out: Outcome) -> None:
    """Build the engine, run the greedy check batch per k, then time every (k, conc) cell; fills `out` as
    it goes, so what finished before a failure is still reported."""
    engine = LLMEngine(EngineConfig(
        model=str(model), device=str(device), dtype=args.dtype, seed=0, max_num_seqs=max(cells),
        # A fixed default k: graphs are captured at start for k = 0 and this k only (not every k "auto" may pick).
        num_speculative_tokens=max(ks),
        # Fail fast: a hung start or step ends this configuration instead of the whole run's time budget, and a
        # lost worker is reported, not silently replaced (recovery would reload and retry the same thing).
        startup_timeout_s=args.startup_timeout, max_faults=1, **overrides))
    try:
        check(engine.tokenizer is not None, f"{model} has no tokenizer.json: text prompts cannot be encoded")
        for k in ks:
            t0 = time.perf_counter()
            out.checked[k] = _generate(engine, prompts, k, args.max_tokens)
            print(f"  check k={k}: {len(prompts)} greedy requests in one batch, {time.perf_counter() - t0:.1f} s")
        for k in ks:
            for c, n in cells.items():
                workloads.drive(engine, _jobs(prompts[:c], k, 8), c, f"warm-k{k}c{c}")  # new batch shapes
                run = out.runs[(k, c)] = workloads.drive(engine, _jobs(prompts[:n], k, args.max_tokens), c,
                                                         f"k{k}c{c}")
                check(all(len(t.token_ids) == args.max_tokens for t in run.traces), "every request emits max_tokens")
                print(f"  k={k} c={c}: {run.tokens_per_s:.1f} tok/s, AL {run.spec.acceptance_length:.2f}, "
                      f"{run.wall:.1f} s", flush=True)
    finally:
        engine.shutdown()


def _jobs(prompts: list[str], k: int, max_tokens: int, logprobs: int | None = None) -> list[workloads.Job]:
    return [workloads.Job(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                            num_speculative_tokens=k, logprobs=logprobs)) for p in prompts]


def _generate(engine: LLMEngine, prompts: list[str], k: int, max_tokens: int) -> list[RequestOutput]:
    """Every prompt submitted at once (the scheduler runs max_num_seqs of them), with top-2 logprobs, which
    tell a flipped near tie from a wrong token when outputs differ."""
    ids = [f"check-k{k}-{i}" for i in range(len(prompts))]
    for rid, job in zip(ids, _jobs(prompts, k, max_tokens, logprobs=2)):
        engine.add_request(rid, job.prompt, job.params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[rid] for rid in ids]


def _free_memory(device: torch.device) -> None:
    """Drop this process's share of the GPU before the next engine (Ray workers free theirs by exiting)."""
    gc.collect()  # the runner's CUDA graphs and pools hang off reference cycles
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            print(f"  this process now holds {torch.cuda.memory_reserved() / 2**20:.0f} MiB of GPU memory")
        except Exception as e:  # a sticky CUDA error of the in-process engine: the Ray workers have their own
            print(f"  could not free this process's GPU memory: {e}")


def _compare_outcomes(name: str, ref: Outcome, got: Outcome) -> list[str]:
    if not (got.checked or got.runs) or not (ref.checked or ref.runs):
        print(f"  vs {REFERENCE}: nothing to compare (a run failed first)")
        return []  # reported as failed, not as a mismatch
    problems, compared = [], 0
    for k, outs in got.checked.items():
        if k in ref.checked:
            compared += 1
            problems += _compare(f"{name} k={k} check batch", [o.token_ids for o in ref.checked[k]],
                                 [o.token_ids for o in outs], [o.logprobs for o in ref.checked[k]])
    for (k, c), run in got.runs.items():
        if (k, c) in ref.runs:
            compared += 1
            problems += _compare(f"{name} k={k} conc={c} timed", [t.token_ids for t in ref.runs[(k, c)].traces],
                                 [t.token_ids for t in run.traces])
    # How many batches were compared: a configuration that failed part-way is compared on what it finished.
    verdict = "token for token" if not problems else f"{len(problems)} request(s) differ"
    print(f"  vs {REFERENCE}: {verdict} ({compared} batch(es) compared)")
    return problems


def _compare(label: str, ref: list[list[int]], got: list[list[int]], ref_logprobs: list | None = None) -> list[str]:
    """One line per request whose tokens differ from the reference's: where, and the reference's top-2 gap."""
    problems = []
    for i, (r, g) in enumerate(zip(ref, got)):
        if r == g:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
        line = (f"MISMATCH {label}, request {i}: first difference at token {pos} ({len(r)} vs {len(g)} "
                f"tokens): {_at(r, pos)} ({REFERENCE}) vs {_at(g, pos)}")
        lps = ref_logprobs[i] if ref_logprobs else None
        if lps and pos < len(lps) and len(lps[pos]) >= 2:
            top = sorted(lps[pos].values(), reverse=True)
            line += f"; {REFERENCE}'s top-2 logprob gap there {top[0] - top[1]:.2e}"
        print(line)
        problems.append(line)
    return problems


def _at(tokens: list[int], pos: int) -> str:
    return str(tokens[pos]) if pos < len(tokens) else "end"


def _table(outcomes: dict[str, Outcome], ks: list[int], cells: dict[int, int]) -> Table:
    table = Table("Ray path vs the in-process engine, greedy", ["config", "k", "conc", "reqs", "out tok/s",
                                                                f"vs {REFERENCE}", "AL", "tokens"])
    ref = outcomes.get(REFERENCE, Outcome()).runs
    for name, out in outcomes.items():
        for k in ks:
            for c, n in cells.items():
                run, base = out.runs.get((k, c)), ref.get((k, c))
                if run is None:
                    table.add(name, str(k), str(c), str(n), "failed", "-", "-", "-")
                    continue
                same = "ref" if name == REFERENCE else "-" if base is None else (
                    "same" if [t.token_ids for t in run.traces] == [t.token_ids for t in base.traces] else "DIFFER")
                table.add(name, str(k), str(c), str(n), f"{run.tokens_per_s:.1f}",
                          run.tokens_per_s / base.tokens_per_s if base else None, run.spec.acceptance_length, same)
    return table


def _notes(args: argparse.Namespace, device: torch.device, model: Path, skipped: dict[str, str],
           failed: dict[str, str], mismatches: list[str]) -> list[str]:
    backend = f"NCCL, {torch.cuda.device_count()} GPUs visible" if device.type == "cuda" else "gloo"
    notes = [f"model: {args.model or 'default model'} ({model.name}), dtype {args.dtype}, {args.max_tokens} tokens "
             f"per request, held-out stdlib prompts; Ray configurations over {backend}",
             "tokens: the timed cell's outputs against the in-process engine's same cell"]
    notes += [f"skipped {name}: {why}" for name, why in skipped.items()]
    notes += [f"FAILED {name}: {why}" for name, why in failed.items()]
    notes.append(f"greedy equality with {REFERENCE}: " + (f"{len(mismatches)} request(s) differ, first: "
                                                          f"{mismatches[0]}" if mismatches else "every request equal"))
    return notes


if __name__ == "__main__":
    sys.exit(main())
