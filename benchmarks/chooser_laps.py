#!/usr/bin/env python
"""Adaptive speculation's host work timed inside the engine, beside the laps it lands in (docs/design.md §9).

    python benchmarks/chooser_laps.py --concurrency 1 --variants auto,4 --requests 40 [--temperature 1]
    python benchmarks/chooser_laps.py --tiny --device cpu --requests 4          # a smoke run, seconds

chooser_overhead.py times the chooser alone in a hot loop; inside the GPU engine the same code runs cold between
the steps' torch work, 3-5x slower on the H200's host (run 276: a cost row 166-323 us there against 30 in the
hot loop on the 2-core CPU). Here one engine drives --requests requests a pass for each variant in turn, and
its chooser's parts are wrapped in timers: per part its calls over 5 us, their wall and thread CPU time (the
two agree where the host computes rather than waits); per pass the laps (LLMEngine.step to step) and the laps
in which the chooser chose (AdaptiveSpec.choosing). The first pass of a variant also compiles and captures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cell_phases  # noqa: E402
import common  # noqa: E402
import spec_matrix  # noqa: E402
import workloads  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.cluster import acceptance, spec_chooser, step_costs  # noqa: E402
from mtpserve.cluster.engine import LLMEngine  # noqa: E402

# (class, method): the chooser's parts, each timed wherever it is called from
PARTS = [(spec_chooser.AdaptiveSpec, "choose"), (spec_chooser.AdaptiveSpec, "_prepare"),
         (spec_chooser.AdaptiveSpec, "_choose_for_newcomers"), (acceptance.AcceptanceTable, "fold"),
         (acceptance.AcceptanceTable, "flush"), (step_costs.StepCosts, "costs"), (step_costs.StepCosts, "_refit")]
BUSY_US = 5.0  # calls under this are a held step's bookkeeping: left out of a part's quantiles

Timings = dict[str, list[tuple[float, float]]]  # per part, (wall us, thread CPU us) of each call


def time_parts(timings: Timings) -> Callable[[], None]:
    """Wrap every part in a timer feeding `timings`; -> a function that unwraps them."""
    originals = [(cls, name, getattr(cls, name)) for cls, name in PARTS]
    for cls, name, method in originals:
        setattr(cls, name, _timed(method, timings[name]))

    def untime() -> None:
        for cls, name, method in originals:
            setattr(cls, name, method)
    return untime


def _timed(method: Callable[..., Any], out: list[tuple[float, float]]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        result = method(*args, **kwargs)
        out.append(((time.perf_counter() - wall) * 1e6, (time.thread_time() - cpu) * 1e6))
        return result
    return timed


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def run_passes(args: argparse.Namespace, engine: LLMEngine, prompts: list, c: int) -> tuple[Table, Table]:
    laps_table = Table(f"laps at c = {c}: every step, and those in which the chooser chose",
                       ["variant", "pass", "tok/s", "AL", "laps", "lap p50 ms", "lap mean ms", "chose", "chose p50 ms",
                        "chose mean ms"])
    parts_table = Table(f"the chooser's parts at c = {c}, calls over {BUSY_US:g} us", ["variant", "pass", "part", "calls",
                        "wall p50 us", "wall p90 us", "wall max us", "cpu p50 us"])
    tracer = cell_phases.StepTracer(engine)  # each step's lap, and whether its chooser chose
    for r in range(args.passes):
        for k in common.parse_ks(args.variants):
            timings: Timings = defaultdict(list)
            tracer.start()
            untime = time_parts(timings)
            run = workloads.drive(engine, spec_matrix.matrix_jobs(args, prompts, k, len(prompts), args.max_tokens), c,
                                  f"p{r}k{k}")
            untime()
            every = [r.seconds * 1e3 for r in tracer.records]
            chose = [r.seconds * 1e3 for r in tracer.records if r.chose]
            laps_table.add(f"MTP{k}", str(r), run.tokens_per_s, f"{run.spec.acceptance_length:.2f}", str(len(every)),
                           quantile(every, 0.5), sum(every) / max(len(every), 1), str(len(chose)),
                           quantile(chose, 0.5), sum(chose) / max(len(chose), 1))
            for name, calls in timings.items():
                busy = [c for c in calls if c[0] > BUSY_US]
                if busy:
                    wall = [w for w, _ in busy]
                    parts_table.add(f"MTP{k}", str(r), name, str(len(busy)), quantile(wall, 0.5), quantile(wall, 0.9),
                                    max(wall), quantile([u for _, u in busy], 0.5))
    return laps_table, parts_table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    spec_matrix.add_matrix_args(p)
    p.add_argument("--variants", default="auto,4", help="draft counts and 'auto', each a pass in turn")
    p.add_argument("--requests", type=int, default=40, help="requests a pass")
    p.add_argument("--passes", type=int, default=2, help="passes of every variant (the first also compiles)")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency="1", max_tokens=16, variants="auto,1", requests=4, passes=1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    c = common.parse_ints(args.concurrency)[0]
    max_k = max((k for k in common.parse_ks(args.variants) if k != spec_matrix.AUTO), default=0)
    with tempfile.TemporaryDirectory(prefix="mtpserve-chooser-laps-") as tmp:
        engine = spec_matrix.build_engine(args, device, Path(tmp), c, max_k)
        prompts = spec_matrix.matrix_prompts(args, args.requests, engine.model_config.vocab_size)
        notes = [spec_matrix.pin_driver(args, device),
                 f"{'greedy' if args.temperature == 0 else f'T={args.temperature:g}'}, {args.workload} prompts, "
                 f"{args.requests} requests a pass of {args.max_tokens} tokens, one engine for every variant"]
        tables = list(run_passes(args, engine, prompts, c))
        engine.shutdown()
    common.report(args, "chooser_laps", device, tables, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
