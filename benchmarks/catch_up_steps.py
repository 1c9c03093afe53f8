#!/usr/bin/env python
"""What a rise of k past lagging MTP modules costs the steps around it: every request runs "auto" with the chooser
replaced by a schedule, high, then low for a while, then high again.

    python benchmarks/catch_up_steps.py --concurrency 32 --low-steps 200 --max-num-batched-tokens 2048
    python benchmarks/catch_up_steps.py --tiny --device cpu          # a smoke run, seconds

Adaptive speculation leaves the modules past the chosen k behind, and when k rises each request is rewound over
its lag (docs/design.md §9), up to Scheduler.MAX_CATCH_UP positions. The scheduler counts those positions against
the step's token budget and spreads a rise over as many steps as the budget needs. Here the schedule is --high for
--lead steps (the prompts' prefill and first drafts), --low for --low-steps steps, then --high to the end; the same
cell runs twice on one engine ("first": compiles and captures the rise needs happen in it; "again"). Per cell: the
steps that carried catch-ups, the requests and positions they rewound, the longest step from the rise on against
the median decode step before it, the steps that took the general path (eager) and the graphs captured while
serving. Run each budget in a fresh process with its own TRITON_CACHE_DIR for a clean "first" row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cell_phases  # noqa: E402
import common  # noqa: E402
import workloads  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402

TOKENS = (1000, 2000)  # prompt ids are drawn from these (ordinary text ids of the default model)


class Schedule:
    """The chooser's stand-in: --high for `lead` calls, --low for `low_steps`, then --high."""

    def __init__(self, high: int, low: int, lead: int, low_steps: int) -> None:
        self.high, self.low, self.lead, self.low_steps, self.calls = high, low, lead, low_steps, 0

    def __call__(self, rows: np.ndarray, batch: int | None = None, newcomers_adaptive: bool = True) -> int:
        self.calls += 1
        return self.low if self.lead < self.calls <= self.lead + self.low_steps else self.high

    @property
    def rise(self) -> int:
        """The call that rises again."""
        return self.lead + self.low_steps + 1


class Counters:
    """Per cell: the positions the scheduler counted as catch-ups and the runner's general-path steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rewound = self.general = 0
        schedule, runner = engine.scheduler.schedule, engine.executor.runner
        general = runner._run_general

        def counted_schedule():
            plan = schedule()
            self.rewound += plan.catch_up_tokens
            return plan

        def counted_general(reqs, plan):
            self.general += 1
            return general(reqs, plan)

        engine.scheduler.schedule, runner._run_general = counted_schedule, counted_general


def cell(engine: LLMEngine, args: argparse.Namespace, name: str, tracer: cell_phases.StepTracer,
         counters: Counters) -> list:
    schedule = Schedule(args.high, args.low, args.lead, args.low_steps)
    engine.adaptive.choose = schedule
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature,
                            num_speculative_tokens="auto")
    vocab = engine.model_config.vocab_size
    ids = (min(TOKENS[0], vocab // 2), min(TOKENS[1], vocab))  # the tiny model's vocabulary is smaller
    jobs = [workloads.Job(rng.integers(*ids, args.prompt_len).tolist(), params) for _ in range(args.concurrency)]
    runner = engine.executor.runner
    captures, catch_ups = getattr(runner, "num_captures", 0), runner.num_catch_ups
    counters.rewound = counters.general = 0
    tracer.start()
    workloads.drive(engine, jobs, args.concurrency, name)
    records = tracer.records
    first = next((i for i, r in enumerate(records) if r.catch_ups), None)
    before = [r.seconds for r in records[:first] if r.batch == args.concurrency and not r.prompt_tokens][-50:]
    after = [r.seconds for r in records[first:]] if first is not None else []
    return [name, sum(1 for r in records if r.catch_ups), runner.num_catch_ups - catch_ups, counters.rewound,
            max(after, default=0.0) * 1e3, statistics.median(before) * 1e3 if before else 0.0,
            counters.general, getattr(runner, "num_captures", 0) - captures]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--high", type=int, default=4)
    p.add_argument("--low", type=int, default=0)
    p.add_argument("--lead", type=int, default=20, help="steps at --high first")
    p.add_argument("--low-steps", type=int, default=200, help="steps at --low (at k = 0 the lag grows one a step)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency=4, lead=4, low_steps=12, max_tokens=48, prompt_len=8,
                         max_num_batched_tokens=32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    with tempfile.TemporaryDirectory(prefix="mtpserve-catch-up-") as tmp:
        model = workloads.resolve_model(args.model, args.tiny, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model), device=str(device), max_num_seqs=args.concurrency,
                                        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed))
        common.check(engine.adaptive is not None and engine.model_config.mtp.num_modules > 0,
                     f"{model}: adaptive speculation needs MTP modules")
        tracer, counters = cell_phases.StepTracer(engine), Counters(engine)
        rows = [cell(engine, args, name, tracer, counters) for name in ("first", "again")]
        engine.shutdown()
    t = Table(f"a rise from k = {args.low} to {args.high} after {args.low_steps} steps, c = {args.concurrency}, "
              f"max_num_batched_tokens {args.max_num_batched_tokens}",
              ["cell", "steps with catch-ups", "requests rewound", "positions counted", "longest step from the rise ms",
               "median decode step before ms", "general-path steps", "graphs captured"])
    for row in rows:
        t.add(*[str(v) if isinstance(v, int) else v for v in row])
    notes = [f"{args.concurrency} requests of {args.prompt_len} random ids, {args.max_tokens} tokens each, "
             f"T = {args.temperature:g}; k forced: {args.high} for {args.lead} steps, {args.low} for {args.low_steps}, "
             f"then {args.high}"]
    common.report(args, "catch_up_steps", device, [t], notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
