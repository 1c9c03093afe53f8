#!/usr/bin/env python
"""Where a spec-matrix cell's time goes: the closed loop's wall time split by the kind of step, per k.

    python benchmarks/cell_phases.py --ks 1,2,4,auto --concurrency 128 --temperature 1 --repeats 2
    python benchmarks/cell_phases.py --tiny --device cpu --ks 1,auto      # a smoke run, seconds

spec_matrix.py ranks whole cells (a closed loop of `conc` requests until 2 x conc have finished), while
adaptive speculation (docs/design.md §9) prices the decode steps of a steady batch. This runs the
matrix's cells on the same engine and workload and splits each one's wall time, step by step (the time
between two returns of LLMEngine.step, attributed to the step whose outputs the second returned), into:

  full     decode steps of the whole batch (conc requests, no prompt tokens)
  partial  decode steps of fewer requests while requests are still being admitted
  prompt   steps that computed prompt tokens (their decoding requests' tokens included)
  catch-up steps that rewound requests whose modules lagged (k rose past them)
  drain    decode steps of fewer requests after the cell's last prompt step

Per phase: steps, ms and tokens emitted (tok/ms: the phase's rate); then the steps run at each k. A phase
the chooser does not price (prompt, drain, catch-up) that differs between k's is where a cell's ranking
can part from the steady decode's. `probe ms` times a fixed piece of plain Python just before and just after
the cell: the host's speed then (the H100 machine's host has run the same cell 2x slower from one cell to
the next, every host phase alike; design §9).
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import cost_samples  # noqa: E402
import host  # noqa: E402
import spec_matrix  # noqa: E402
import token_counts  # noqa: E402
import workloads  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.boundary.messages import StepPlan  # noqa: E402
from mtpserve.cluster import spec_chooser  # noqa: E402
from mtpserve.cluster.engine import LLMEngine  # noqa: E402

PHASES = ("full", "partial", "prompt", "catch-up", "drain")


@dataclass(frozen=True)
class StepRecord:
    seconds: float  # since the previous step() returned (the first: since the cell began)
    batch: int  # requests in the step whose outputs this step() returned
    prompt_tokens: int
    tokens: int  # tokens emitted
    k: int  # the step's chain: its largest num_spec
    catch_ups: int  # requests rewound by the steps launched in this step() call
    schedule: float  # seconds the scheduler took to plan it (plain Python: it moves with the host's speed)
    faults: int  # minor page faults of the process during this step() call (memory the allocator mapped anew)
    chose: bool = False  # adaptive speculation made a choice in this step() call (AdaptiveSpec.choosing)
    gc_seconds: float = 0.0  # garbage collection inside this step() call


class GcClock:
    """Seconds the interpreter's garbage collector has run since this was made (through gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self._began = 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


class StepTracer:
    """Records every LLMEngine.step of a cell, wrapping the engine's step and postprocess in place."""

    def __init__(self, engine: LLMEngine) -> None:
        self.records: list[StepRecord] = []
        self._last_k, self._t, self._gc = 0, 0.0, GcClock()
        runner = getattr(engine.executor, "runner", None)
        self._catch_ups = lambda: getattr(runner, "num_catch_ups", 0)
        chose = (lambda: engine.adaptive.choosing) if engine.adaptive is not None else (lambda: False)
        step, postprocess = engine.step, engine._postprocess

        def traced_postprocess(plan: StepPlan, *a: Any) -> Any:
            self._last_k = max(plan.num_spec, default=0)
            return postprocess(plan, *a)

        def traced_step() -> Any:
            caught, faults, collected = self._catch_ups(), minor_faults(), self._gc.seconds
            out = step()
            now, stats = time.perf_counter(), engine.last_stats
            self.records.append(StepRecord(now - self._t, stats.batch_size, stats.num_prompt_tokens,
                                           stats.num_generation_tokens, self._last_k, self._catch_ups() - caught,
                                           stats.schedule_seconds, minor_faults() - faults, chose(),
                                           self._gc.seconds - collected))
            self._t = now
            return out

        engine._postprocess, engine.step = traced_postprocess, traced_step

    def start(self) -> None:
        self.records, self._t = [], time.perf_counter()


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def phase_of(records: list[StepRecord], concurrency: int) -> list[str]:
    """Each step's phase (see the module's docstring)."""
    last_prompt = max((i for i, r in enumerate(records) if r.prompt_tokens), default=-1)
    return ["prompt" if r.prompt_tokens else "catch-up" if r.catch_ups else "full" if r.batch >= concurrency
            else "drain" if i > last_prompt else "partial" for i, r in enumerate(records)]


def phase_cells(records: list[StepRecord], concurrency: int) -> list[str]:
    """Per phase 'steps / ms / tok/ms', the full steps' medians 'lap ms / schedule us / page faults' and their excess
    (excess_cell), then the requests caught up and the steps per k."""
    phases = phase_of(records, concurrency)
    cells = []
    for phase in PHASES:
        mine = [r for r, p in zip(records, phases) if p == phase]
        ms, tokens = sum(r.seconds for r in mine) * 1e3, sum(r.tokens for r in mine)
        cells.append(f"{len(mine)} / {ms:.0f} / {tokens / ms:.1f}" if ms else "0")
    full = [r for r, p in zip(records, phases) if p == "full"]
    if full:
        cells.append(f"{statistics.median(r.seconds for r in full) * 1e3:.3f} / "
                     f"{statistics.median(r.schedule for r in full) * 1e6:.0f} / "
                     f"{statistics.median(r.faults for r in full):.0f}")
        cells.append(excess_cell(full))
    else:
        cells += ["-", "-"]
    per_k = Counter(r.k for r in records if r.batch)
    return cells + [str(sum(r.catch_ups for r in records)), " ".join(f"{k}:{n}" for k, n in sorted(per_k.items()))]


def excess_cell(full: list[StepRecord]) -> str:
    """'ms / ms in n' of the full steps: their time beyond the median lap, and the part of it in the n steps where
    adaptive speculation made a choice (a median lap that matches fixed k's while the cell runs slower is time
    lost in outliers; at c = 1 on the H200 the choices held 2-5 ms of auto's 35-48, run 257)."""
    lap = statistics.median(r.seconds for r in full)
    chose = [r for r in full if r.chose]
    excess = sum(max(r.seconds - lap, 0.0) for r in full) * 1e3
    return f"{excess:.1f} / {sum(max(r.seconds - lap, 0.0) for r in chose) * 1e3:.1f} in {len(chose)}"


def outlier_lines(records: list[StepRecord], concurrency: int, count: int) -> list[str]:
    """The `count` full steps furthest above the full steps' median lap, in step order, each with what ran in it:
    its k and the step before's, a choice, the schedule, page faults, garbage collection and catch-ups (what an
    excess that the choices do not hold is made of, at c = 128 on the H200, run 262)."""
    phases = phase_of(records, concurrency)
    full = [i for i, p in enumerate(phases) if p == "full"]
    if not full:
        return []
    lap = statistics.median(records[i].seconds for i in full)
    worst = sorted(sorted(full, key=lambda i: records[i].seconds, reverse=True)[:count])
    return [f"step {i}: lap {r.seconds * 1e3:.3f} ms (+{(r.seconds - lap) * 1e3:.3f}), "
            f"k {records[i - 1].k if i else '-'} -> {r.k}{', chose' if r.chose else ''}, "
            f"sched {r.schedule * 1e6:.0f} us, {r.faults} faults, gc {r.gc_seconds * 1e3:.2f} ms, "
            f"after a {phases[i - 1] if i else '-'} step"
            for i, r in ((i, records[i]) for i in worst)]


class CostTracer:
    """What the step-cost model was fed (StepCosts.observe, wrapped in place) in full-batch decode steps, per k:
    the lap, the host's share (lap - blocked on the device) and the device's (design §9)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.samples: list[tuple[int, int, float, float, float]] = []  # (batch, k, lap, host, device)
        costs = engine.adaptive.costs
        observe = costs.observe

        def traced(batch: int, k: int, device: float, host: float = 0.0, overlapped: bool = False,
                   tokens: float = 0.0, greedy: bool = True, lap: float = 0.0) -> None:
            self.samples.append((batch, k, lap, host, device))
            observe(batch, k, device, host, overlapped, tokens, greedy, lap)

        costs.observe = traced

    def take(self, concurrency: int) -> str:
        """'k: laps, mean lap / lap / host / device ms (the last three medians)' per k over the full batches since the
        last take."""
        samples, self.samples = self.samples, []
        per_k: dict[int, list[tuple[float, float, float]]] = {}
        for batch, k, lap, host_s, device in samples:
            if batch == concurrency:
                per_k.setdefault(k, []).append((lap, host_s, device))
        return "; ".join(f"k={k}: {len(v)} laps, {statistics.mean(x[0] for x in v) * 1e3:.3f} / "
                         + " / ".join(f"{statistics.median(x[i] for x in v) * 1e3:.3f}" for i in range(3))
                         for k, v in sorted(per_k.items()))


class OutcomeTracer:
    """Every request step's (drafts, accepted), as the scheduler hands them to adaptive speculation's acceptance
    table (wrapped in place): each k's tokens a step, by the product of per-position rates and by counting
    (token_counts.py), to set beside the fixed-k cells' acceptance length."""

    def __init__(self, engine: LLMEngine) -> None:
        self.outcomes: list[tuple[int, int]] = []
        table = engine.adaptive.acceptance
        observe_step = table.observe_step

        def traced(seen: list[tuple[int, int, int]]) -> None:
            self.outcomes += [(drafts, accepted) for _, drafts, accepted in seen]
            observe_step(seen)

        table.observe_step = traced

    def start(self) -> None:
        self.outcomes = []

    def take(self, max_k: int) -> str:
        outcomes, self.outcomes = self.outcomes, []
        ks = range(1, max_k + 1)
        return (f"k = 1..{max_k}: product " + " ".join(f"{token_counts.product_tokens(outcomes, k):.2f}" for k in ks)
                + ", counted " + " ".join(f"{token_counts.counted_tokens(outcomes, k):.2f}" for k in ks))


def cost_parts(engine: LLMEngine, tokens: list[float]) -> str:
    """What a choice's cost row is made of at the batch it priced (StepCosts.costs): the host's share per k, the
    device's plus the gap, and the host's recent speeds over the speed now (min / median / 75th / max), whose
    spread lifts a k whose host is about as slow as its device."""
    adaptive = engine.adaptive
    costs, batch = adaptive.costs, max(adaptive._batch, 1)
    fit = costs._host_fit(batch, refit=False)
    host = costs._host(batch, fit, tokens)
    floors = [d + g for d, g in zip(costs.device(batch, adaptive.greedy).tolist(), costs.gaps(batch).tolist())]
    q = sorted(fit[4])
    speeds = [q[0], q[len(q) // 2], q[(3 * len(q)) // 4], q[-1]]
    return (f"host ms {[round(h * 1e3, 3) for h in host]}, device + gap ms {[round(f * 1e3, 3) for f in floors]}, "
            f"speeds {[round(v, 2) for v in speeds]}")


class ChoiceTracer:
    """Every k adaptive speculation chooses (spec_chooser.choose_k, wrapped in place): the step, what it priced
    each k at and the tokens it expected, and the k it kept or took (before AdaptiveSpec explores k - 1 or
    probes k + 1)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.lines: list[str] = []
        scheduler, choose = engine.scheduler, spec_chooser.choose_k
        self.choose = choose  # the function it wraps

        def traced(gains: list[float], base: float, floor: int, cost: Any, current: int, *rest: Any) -> int:
            k = choose(gains, base, floor, cost, current, *rest)  # rest: the hysteresis and what it depends on
            tokens = [base + sum(gains[:j]) for j in range(len(cost))]
            ms = [float(c) * 1e3 for c in cost]
            rates = [round(t / c, 1) for t, c in zip(tokens, ms)]
            self.lines.append(f"step {scheduler.num_steps}: batch {len(scheduler.running)}+{len(scheduler.waiting)}, "
                              f"k {current} -> {k}; cost ms {[round(c, 3) for c in ms]}, tokens "
                              f"{[round(t, 1) for t in tokens]}, tok/ms {rates}; {cost_parts(engine, tokens)}")
            return k

        spec_chooser.choose_k = traced

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def _cell(engine: LLMEngine, tracer: StepTracer, choices: ChoiceTracer | None, costs: CostTracer | None,
          outcomes: OutcomeTracer | None, outliers: int, jobs: list[workloads.Job], c: int, name: str,
          greedy: bool) -> list:
    """Run one cell of c in flight, traced -> its row from `probe ms` on (printing its choices, auto's prices and
    the tokens its steps say each k makes and its slowest full steps, when asked)."""
    probe = host.host_probe()
    if choices is not None:
        choices.take()  # the warm-up's and the last cell's
    if costs is not None:
        costs.take(c)
    if outcomes is not None:
        outcomes.start()  # the warm-up's and the last cell's
    tracer.start()
    run = workloads.drive(engine, jobs, c, name.replace(" ", "-"))
    if choices is not None:
        print(f"choices of {name}:", *choices.take(), sep="\n  ")
    if costs is not None:
        print(f"fed to the step costs, {name}, full batches, mean lap / lap / host / device ms: {costs.take(c)}")
    if outcomes is not None:
        print(f"tokens a step from the steps of {name}, {outcomes.take(engine.adaptive.config.max_k)}")
    if outliers:
        print(f"the {outliers} slowest full steps of {name}:", *outlier_lines(tracer.records, c, outliers), sep="\n  ")
    if jobs[0].params.num_speculative_tokens == spec_matrix.AUTO and engine.adaptive is not None:
        print(f"auto {name}: {spec_matrix.describe_auto(engine, c, greedy)}")
    return [f"{probe:.2f} / {host.host_probe():.2f}", run.tokens_per_s, run.spec.acceptance_length,
            *phase_cells(tracer.records, c)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    spec_matrix.add_matrix_args(p)
    p.add_argument("--trace-choices", action="store_true", help="print every choice of an auto cell: the cost and "
                   "tokens the chooser saw per k")
    p.add_argument("--trace-costs", action="store_true", help="print per cell and k the medians of the laps, host and "
                   "device shares the step-cost model was fed in full-batch steps (and the laps' mean)")
    p.add_argument("--dump-samples", metavar="PATH", help="write every step-cost sample and choice, each tagged with "
                   "its cell, as JSON (cost_samples.py; gzipped where PATH ends in .gz)")
    p.add_argument("--trace-outliers", type=int, default=0, metavar="N", help="print per cell its N slowest full "
                   "steps and what ran in each")
    p.add_argument("--trace-tokens", action="store_true", help="print per cell each k's tokens a step drawn from its "
                   "steps, as the product of per-position rates and by counting (token_counts.py)")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency="4", max_tokens=16, min_requests=4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    ks, concurrency = common.parse_ks(args.ks), common.parse_ints(args.concurrency)
    max_k = max((k for k in ks if k != spec_matrix.AUTO), default=0)
    cells = {c: max(args.min_requests, args.requests_per_slot * c) for c in concurrency}
    table = Table(f"cell phases: {'greedy' if args.temperature == 0 else f'T={args.temperature:g}'}, "
                  f"{args.workload} prompts, {args.max_tokens} tokens per request; phase: steps / ms / tok/ms",
                  ["MTP", "conc", "round", "probe ms", "out tok/s", "AL", *PHASES, "full lap ms / sched us / faults",
                   "full excess ms / of it in choices", "caught up", "steps per k"])
    with tempfile.TemporaryDirectory(prefix="mtpserve-cell-phases-") as tmp:
        engine = spec_matrix.build_engine(args, device, Path(tmp), max(concurrency), max_k)
        prompts = spec_matrix.matrix_prompts(args, max(cells.values()), engine.model_config.vocab_size)

        def jobs(k: int | str, n: int, max_tokens: int) -> list[workloads.Job]:
            return spec_matrix.matrix_jobs(args, prompts, k, n, max_tokens)

        spec_matrix.warm_up(lambda js, c, prefix: workloads.drive(engine, js, c, prefix), jobs, ks, cells,
                            args.max_tokens)
        tracer, pinned = StepTracer(engine), []
        choices = ChoiceTracer(engine) if args.trace_choices else None
        costs = CostTracer(engine) if args.trace_costs and engine.adaptive is not None else None
        outcomes = OutcomeTracer(engine) if args.trace_tokens and engine.adaptive is not None else None
        log = cost_samples.SampleLog() if args.dump_samples else None
        if log is not None:
            log.wrap(engine)
        for c in concurrency:
            for r in range(args.repeats):  # the k's in spec_matrix.py's balanced order
                pinned.append(f"c={c} round {r}: {spec_matrix.pin_driver(args, device)}")
                for k in common.balanced_order(ks, r):
                    if log is not None:
                        log.at(f"k={k} c={c}", r)
                    row = _cell(engine, tracer, choices, costs, outcomes, args.trace_outliers,
                                jobs(k, cells[c], args.max_tokens), c,
                                f"k={k} c={c} round {r}", args.temperature == 0)
                    table.add(f"MTP{k}", str(c), str(r), *row)
        engine.shutdown()
    if log is not None:
        log.write(args.dump_samples)
    common.report(args, "cell_phases", device, [table],
                  ["phases as in benchmarks/cell_phases.py's docstring; a step's time is the wall between two "
                   "returns of LLMEngine.step, attributed to the step whose outputs the second returned", *pinned])
    return 0


if __name__ == "__main__":
    sys.exit(main())
