#!/usr/bin/env python
"""Auto against fixed k with the host's drift paired out: an engine per variant, their short cells interleaved.

    python benchmarks/interleaved.py --ks 2,auto --concurrency 1 --temperature 1 --rounds 150
    python benchmarks/interleaved.py --ks 0,1,2,3,4,auto --concurrency 1,8,32,128,256 --budget-s 540
    python benchmarks/interleaved.py --tiny --device cpu --ks 1,auto --rounds 2     # a smoke run, seconds

spec_matrix.py runs every k on one engine, a cell of 2 x conc requests (about a second) at a time, and on the
H200 the host's speed moved within its rounds: one cell's runs spread 0.8-24 % (session AC, runs 268 and 271),
0.4-12x issue 11's 2 % margin. Here each variant (a fixed k, or auto) has its own engine, so none learns from
another's steps, and a round runs one short cell of each (--requests-per-cell requests, by default twice the
concurrency: at c = 1 two, a few tenths of a second), the variants in a balanced order, all on the same prompts and
seeds. A slow spell of the host then falls on every variant alike, and each round gives a paired ratio. On the
H200, 150 rounds at c = 1 put a 90 % interval of about +-0.8 % on auto / fixed k (session AD, runs 274-281),
though the ratio moved more than that between runs, whose engines learn their costs anew.

Per variant: its tok/s over all rounds (tokens / seconds, summed), its acceptance length, and auto's tok/s over its
own with a 90 % interval (a bootstrap over rounds of the ratio of sums). With --budget-s each concurrency gets an
equal share of the budget left when it starts (engines built and warmed inside it), and runs rounds while the last
one's time still fits. --dump-samples writes every engine's step-cost samples and auto's choices for
replay_costs.py; --phases adds each variant's steps by phase, and the host parts of its full-batch steps at each k
and of its drain steps (host_parts.py: the step's own pieces, GC, page faults and a probe of the core's own speed;
"other" also holds the tracers' own reads). A variant "auto:FIELD=VALUE[+...]" runs auto with those AdaptiveConfig
fields changed (an A/B of the chooser beside auto as it is, e.g. auto:max_probe_wait=1). A variant "VARIANT#NAME" is
another engine of that variant ("4,4#b,auto"): its ratio to the first, with its interval, is an A/A control of how
far two engines of one variant differ. A variant "K@VARIANT" runs k = K's requests on that variant's engine
("4,auto,4@auto": fixed k = 4 on auto's engine, whose cost model then also learns from them): set beside 4, it says
whether a slower step follows the engine or auto's requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cell_phases  # noqa: E402
import common  # noqa: E402
import cost_samples  # noqa: E402
import host_parts  # noqa: E402
import pool_cells  # noqa: E402
import spec_matrix  # noqa: E402
import workloads  # noqa: E402
from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from common import Table  # noqa: E402

import torch  # noqa: E402

Cell = tuple[int, float, float]  # tokens, seconds, acceptance length


def ratio_interval(auto: list[Cell], fixed: list[Cell], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(auto's tok/s over fixed's, summed over the rounds; its 5th and 95th percentiles over rounds resampled with
    replacement). The two lists hold the same rounds, in order."""
    return pool_cells.pooled([(auto, fixed)], draws, seed)[0][0]


COPY = "#"  # "4#b": another engine of variant 4, an A/A control of how far two engines of one variant differ
SHARE = "@"  # "4@auto": k = 4's requests on the auto variant's engine: does a slower step follow the engine or the k?


def parse_variants(text: str) -> list[int | str]:
    """--ks: draft counts, "auto", auto's variants "auto:FIELD=VALUE[+FIELD=VALUE...]" (AdaptiveConfig fields),
    copies of any of them, "VARIANT#NAME", and "K@VARIANT", a draft count's requests on another variant's engine."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    bad = [part for part in parts if not str(original(part)).startswith(spec_matrix.AUTO)
           and not str(original(part)).isdigit() or SHARE in part and not part.split(SHARE, 1)[0].isdigit()]
    if bad:
        raise SystemExit(f"--ks: {bad}: a variant is a draft count, auto, auto:FIELD=VALUE[+...], VARIANT#NAME or "
                         "K@VARIANT")
    variants = [_variant(part) for part in parts]
    for v in variants:
        if COPY in str(v) and original(v) not in variants:
            raise SystemExit(f"--ks: {v!r} copies {original(v)!r}, which is not among the variants")
        if SHARE in str(v) and (host(v) not in variants or SHARE in str(host(v))):
            raise SystemExit(f"--ks: {v!r} runs on {host(v)!r}'s engine: name that variant too, with its own engine")
    if len(set(variants)) != len(variants):
        raise SystemExit(f"--ks: {text!r} names a variant twice (a second engine of one is VARIANT#NAME)")
    return variants


def original(variant: int | str) -> int | str:
    """The variant a copy ("4#b") copies, or whose requests a shared variant ("4@auto") runs; any other itself."""
    marks = [str(variant).find(m) for m in (COPY, SHARE) if m in str(variant)]
    if not marks:
        return variant
    return _variant(str(variant)[:min(marks)])


def host(variant: int | str) -> int | str:
    """The variant whose engine runs this one's cells: "4@auto" runs on auto's; any other on its own."""
    if SHARE not in str(variant):
        return variant
    return _variant(str(variant).split(SHARE, 1)[1])


def _variant(text: str) -> int | str:
    """A variant as --ks names it: a draft count as an int, any other as its text."""
    return int(text) if text.isdigit() else text


def speculation(variant: int | str) -> int | str:
    """The requests' num_speculative_tokens in a variant's cells: "auto" for every auto variant."""
    base = original(variant)
    return spec_matrix.AUTO if str(base).startswith(spec_matrix.AUTO) else base


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def tune(engine: LLMEngine, variant: int | str) -> None:
    """An auto variant's AdaptiveConfig overrides, set on its engine's chooser (AdaptiveSpec.config: what the chooser
    reads there, not the acceptance table's copy)."""
    variant = original(variant)
    if not str(variant).startswith(spec_matrix.AUTO + ":"):
        return
    items = str(variant).split(":", 1)[1].split("+")
    if not all(item.count("=") == 1 for item in items):
        raise SystemExit(f"--ks: {variant!r}: an auto variant is auto:FIELD=VALUE[+FIELD=VALUE...]")
    fields = {name: _number(value) for name, value in (item.split("=") for item in items)}
    known = {f.name for f in dataclasses.fields(engine.adaptive.config)}
    if not fields.keys() <= known:
        raise SystemExit(f"--ks: {variant!r}: AdaptiveConfig has no field {sorted(fields.keys() - known)}")
    engine.adaptive.config = dataclasses.replace(engine.adaptive.config, **fields)


def build_engines(args: argparse.Namespace, device: torch.device, tmp: Path, ks: list[int | str], c: int) -> dict:
    """An engine per variant (spec_matrix's, with the matrix's engine flags), each with an equal share of the GPU's
    memory; a shared variant ("4@auto") gets its host's."""
    max_k = max((k for k in map(original, ks) if isinstance(k, int)), default=0)
    own = [k for k in ks if host(k) == k]
    engines = {k: spec_matrix.build_engine(args, device, tmp, c, max_k, memory_share=1.0 / len(own)) for k in own}
    for k, engine in engines.items():
        tune(engine, k)
    return {k: engines[host(k)] for k in ks}


def distinct(engines: dict) -> dict:
    """Per engine, the first variant that runs on it (shared variants run on their host's)."""
    return {id(engine): k for k, engine in reversed(list(engines.items()))}


PROMPT_POOL = 600  # distinct prompts at most: the stdlib source holds about 650 held-out functions


def cell_size(args: argparse.Namespace, c: int) -> int:
    """Requests in one cell at concurrency c: --requests-per-cell, by default twice the concurrency."""
    return args.requests_per_cell or 2 * c


def round_prompts(args: argparse.Namespace, vocab: int, n: int) -> list[list]:
    """Each round's prompts (n a cell): distinct rounds while the pool lasts, then the same rounds again (every
    variant's cell of a round still gets the same prompts)."""
    distinct = max(1, min(args.rounds, PROMPT_POOL // n))
    prompts = spec_matrix.matrix_prompts(args, distinct * n, vocab)
    return [prompts[(r % distinct) * n:(r % distinct + 1) * n] for r in range(args.rounds)]


CHOOSER_WORKED = 5e-6  # a step whose chooser preparation took longer did a piece of a choice (a call alone: ~1 us)
IDLE = 4  # steps since the chooser last worked (prepared or chose) from which a step counts as away from its work


class PhaseSums:
    """Per variant, its cells' steps summed over rounds by phase (cell_phases.py's: full, partial, prompt, catch-up,
    drain; each step timed by cell_phases.StepTracer): steps, seconds and tokens, and the steps where adaptive
    speculation chose (AdaptiveSpec.choosing) with their seconds. Paired by round like the cells, it says in which
    phase auto's time goes where a fixed k's does not."""

    def __init__(self, engines: dict) -> None:
        # One tracer an engine, shared by the variants that run on it (each cell starts it afresh).
        tracers = {key: cell_phases.StepTracer(engines[k]) for key, k in distinct(engines).items()}
        parts = {key: host_parts.HostParts(engines[k]) for key, k in distinct(engines).items()}  # wraps the tracer
        self.tracers = {k: tracers[id(engine)] for k, engine in engines.items()}
        self.parts = {k: parts[id(engine)] for k, engine in engines.items()}
        self.sums: dict[int | str, dict[str, list[float]]] = {k: {} for k in engines}
        # Per variant and k, its full-batch steps' (lap, parts), the k unchanged from the step before.
        self.full: dict[int | str, dict[int, list[tuple[float, dict[str, float]]]]] = {k: {} for k in engines}
        # Per variant, every drain step's (lap, parts): where the batch crosses buckets, auto chooses unprepared.
        self.drain: dict[int | str, list[tuple[float, dict[str, float]]]] = {k: [] for k in engines}

    def start(self, k: int | str) -> None:
        self.tracers[k].start()
        self.parts[k].start()

    def add(self, k: int | str, c: int) -> None:
        records = self.tracers[k].records
        last_k, since = (records[0].k if records else 0), IDLE
        for r, phase, parts in zip(records, cell_phases.phase_of(records, c), self.parts[k].steps):
            since = 0 if r.chose or parts.get("prepare", 0.0) > CHOOSER_WORKED else since + 1
            step = (r.seconds, {**parts, "gc": r.gc_seconds, "faults": r.faults, "since": since, "chose": r.chose})
            if phase == "full" and r.k == last_k and not r.chose:
                self.full[k].setdefault(r.k, []).append(step)
            elif phase == "drain":
                self.drain[k].append(step)
            extra = (("choosing",) if r.chose else ()) + (("k moved",) if r.k != last_k else ())
            last_k = r.k
            for key in (phase, *extra):
                steps, seconds, tokens = self.sums[k].setdefault(key, [0, 0.0, 0])
                self.sums[k][key] = [steps + 1, seconds + r.seconds, tokens + r.tokens]

    def table(self, c: int) -> Table:
        extra = ("choosing", "k moved")
        t = Table(f"phases at c = {c}, summed over rounds: steps / ms / tok/ms (choosing: the steps in which auto "
                  "chose, any phase; k moved: the steps whose k was not the step's before)",
                  ["variant", *cell_phases.PHASES, *extra])
        for k, sums in self.sums.items():
            t.add(f"MTP{k}", *(f"{int(n)} / {s * 1e3:.0f} / {tok / max(s * 1e3, 1e-9):.1f}" if n else "0"
                               for n, s, tok in (sums.get(p, (0, 0.0, 0)) for p in (*cell_phases.PHASES, *extra))))
        return t

    def parts_tables(self, c: int) -> list[Table]:
        """Per k that two variants ran at the full batch, their steps' host parts side by side (host_parts.py)."""
        ks = sorted({k for full in self.full.values() for k in full})
        tables = []
        for k in ks:
            rows = {f"MTP{v}": full[k] for v, full in self.full.items() if len(full.get(k, ())) >= 10}
            for v, full in self.full.items():  # auto's steps near its chooser's work and away from it
                near = [x for x in full.get(k, ()) if x[1]["since"] < IDLE]
                if speculation(v) == spec_matrix.AUTO and near and len(near) < len(full[k]):
                    rows[f"MTP{v}, chooser 0-{IDLE - 1} steps back"] = near
                    rows[f"MTP{v}, chooser {IDLE}+ steps back"] = [x for x in full[k] if x[1]["since"] >= IDLE]
            rows = _mean_laps(rows)
            if len(rows) >= 2:
                tables.append(host_parts.parts_table(
                    f"host parts at c = {c}, k = {k}: full-batch steps at the k of the step before, no choice "
                    "made (auto's also split by the steps since its chooser last prepared or chose); mean us a step "
                    "(in parentheses: parts inside those before them)", rows))
        return tables + self._drain_table(c)

    def _drain_table(self, c: int) -> list[Table]:
        """Every drain step's host parts per variant, auto's also split by whether the step chose: a drain whose steps
        run the same k in two variants and lasts longer in one says here whether its choices or its other steps do."""
        rows = {f"MTP{v}": steps for v, steps in self.drain.items()}
        for v, steps in self.drain.items():
            if speculation(v) == spec_matrix.AUTO:
                rows[f"MTP{v}, chose"] = [x for x in steps if x[1]["chose"]]
                rows[f"MTP{v}, held"] = [x for x in steps if not x[1]["chose"]]
        rows = _mean_laps(rows)
        if len(rows) < 2:
            return []
        return [host_parts.parts_table(f"host parts at c = {c}, drain: every step after the cell's last prompt step "
                                       "below the full batch, any k (auto's also split by whether it chose); mean us "
                                       "a step (steps x mean = the phase's time)", rows)]


def _mean_laps(rows: dict[str, list[tuple[float, dict[str, float]]]]) -> dict[str, tuple[float, list[dict]]]:
    """Per row of at least 10 steps, (its laps' mean seconds, its steps' parts): host_parts.parts_table's rows."""
    return {name: (sum(x[0] for x in steps) / len(steps), [x[1] for x in steps])
            for name, steps in rows.items() if len(steps) >= 10}


def run_rounds(args: argparse.Namespace, engines: dict, rounds: list[list], c: int, deadline: float | None = None,
               log: cost_samples.SampleLog | None = None, phases: PhaseSums | None = None
               ) -> dict[int | str, list[Cell]]:
    """Every round, one cell per variant on that round's prompts, in a balanced order; past the first, a round
    starts only where the last one's time still fits before `deadline` (time.monotonic; None: all of them).
    -> per variant its cells."""
    n = len(rounds[0])
    cells: dict[int | str, list[Cell]] = {k: [] for k in engines}
    last = 0.0
    for r, prompts in enumerate(rounds):
        if r and deadline is not None and time.monotonic() + last > deadline:
            break
        began = time.monotonic()
        for k in common.balanced_order(list(engines), r):
            jobs = spec_matrix.matrix_jobs(args, prompts, speculation(k), n, args.max_tokens)
            if log is not None:
                log.at(f"k={k} c={c}", r)
            if phases is not None:
                phases.start(k)
            run = workloads.drive(engines[k], jobs, c, f"r{r}k{k}c{c}")
            if phases is not None:
                phases.add(k, c)
            cells[k].append((run.num_tokens, run.wall, run.spec.acceptance_length))
        last = time.monotonic() - began
    return cells


def table_for(cells: dict[int | str, list[Cell]], c: int) -> Table:
    t = Table(f"interleaved cells at c = {c}: tok/s summed over rounds; auto over each fixed k with a 90 % bootstrap "
              "interval over rounds",
              ["variant", "conc", "rounds", "tokens", "tok/s", "AL", "auto / this", "90 % interval"])
    auto = cells.get(spec_matrix.AUTO)
    for k, mine in cells.items():
        tokens, seconds = sum(x[0] for x in mine), sum(x[1] for x in mine)
        al = sum(x[2] * x[0] for x in mine) / max(tokens, 1)  # weighted by tokens
        if auto is None or k == spec_matrix.AUTO:
            shown = ["-", "-"]
        else:
            ratio, low, high = ratio_interval(auto, mine)
            shown = [f"{ratio:.3f}", f"{low:.3f} - {high:.3f}"]
        t.add(f"MTP{k}", str(c), str(len(mine)), str(tokens), tokens / seconds, f"{al:.2f}", *shown)
    return t


def copies_table(cells: dict[int | str, list[Cell]], c: int) -> Table | None:
    """Each copy ("4#b", or "4@auto": k = 4's requests on auto's engine) over the variant it copies, paired by round:
    where two engines of one variant differ by more than the interval, engines differ, and so does a ratio of auto
    over a fixed k by as much. None: no copy."""
    copies = [v for v in cells if original(v) != v and original(v) in cells]
    if not copies:
        return None
    t = Table(f"copies at c = {c}: a variant's requests on another engine over on its own, paired by round (an A/A "
              "control; K@VARIANT: on that variant's engine)", ["copy", "of", "rounds", "copy / original",
                                                                 "90 % interval"])
    for v in copies:
        ratio, low, high = ratio_interval(cells[v], cells[original(v)])
        t.add(f"MTP{v}", f"MTP{original(v)}", str(len(cells[v])), f"{ratio:.3f}", f"{low:.3f} - {high:.3f}")
    return t


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    spec_matrix.add_matrix_args(p)
    p.add_argument("--rounds", type=int, default=32, help="cells per variant, interleaved")
    p.add_argument("--dump-samples", metavar="PATH", help="write every step-cost sample and choice of every engine "
                   "as JSON (cost_samples.py), for benchmarks/replay_costs.py")
    p.add_argument("--cells-out", metavar="PATH", help="write every variant's cells (tokens, seconds, AL per round) as "
                   "JSON, for pool_cells.py to pool a ratio over several runs")
    p.add_argument("--phases", action="store_true", help="also a table per concurrency of each variant's steps by "
                   "phase (cell_phases.py's), summed over rounds")
    p.add_argument("--requests-per-cell", type=int, default=None,
                   help="requests in one cell (default: 2 x the concurrency; a smaller cell at c > 1 is mostly ramp-up "
                        "and drain)")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency="1", max_tokens=16, ks="1,auto")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    ks, tables, notes = parse_variants(args.ks), [], []
    concurrency = common.parse_ints(args.concurrency)
    end = None if args.budget_s is None else time.monotonic() + args.budget_s
    log = cost_samples.SampleLog() if args.dump_samples else None
    pooled: dict[str, dict[str, list[Cell]]] = {}  # per concurrency, per variant, its cells (--cells-out)
    with tempfile.TemporaryDirectory(prefix="mtpserve-interleaved-") as tmp:
        for i, c in enumerate(concurrency):  # each concurrency gets an equal share of the budget left
            deadline = None if end is None else time.monotonic() + (end - time.monotonic()) / (len(concurrency) - i)
            engines = build_engines(args, device, Path(tmp), ks, c)
            first, n = next(iter(engines.values())), cell_size(args, c)
            rounds = round_prompts(args, first.model_config.vocab_size, n)
            for k, engine in engines.items():  # compiles, captures and fills the prefix cache before the clock runs
                warm = spec_matrix.matrix_jobs(args, rounds[0], speculation(k), n, args.max_tokens)
                workloads.drive(engine, warm, c, f"warm{k}c{c}")
            notes.append(f"c={c}: {n} requests a cell; {spec_matrix.pin_driver(args, device)}")
            if log is not None:  # an engine once: a shared variant's samples go to its host's engine's model
                for k in distinct(engines).values():
                    log.wrap(engines[k], f"k={k} c={c}")
            phases = PhaseSums(engines) if args.phases else None
            cells = run_rounds(args, engines, rounds, c, deadline, log, phases)
            pooled[str(c)] = {str(k): mine for k, mine in cells.items()}
            tables += [t for t in (table_for(cells, c), copies_table(cells, c)) if t is not None]
            if phases is not None:
                tables.append(phases.table(c))
                tables += phases.parts_tables(c)
            for k in distinct(engines).values():
                engines[k].shutdown()
    if log is not None:
        log.write(args.dump_samples)
    if args.cells_out:
        Path(args.cells_out).write_text(json.dumps({"commit": args.commit or common.git_commit(), "cells": pooled}))
    notes.append(f"{'greedy' if args.temperature == 0 else f'T={args.temperature:g}'}, {args.workload} prompts, "
                 f"{args.max_tokens} tokens per request, an engine per "
                 "variant (none learns from another's steps), the same prompts and seeds in every variant's cell of a "
                 "round")
    common.report(args, "interleaved", device, tables, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
