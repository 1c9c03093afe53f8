"""Where each LLMEngine.step's host time goes: named parts of the step timed in place, step by step.

interleaved.py --phases found auto's full-batch steps at the same k 2-6 % slower than a fixed k's, host-bound, on
the H200 (session AN), where the CPU's host-only engine showed about 1 %. This splits every step into the engine's
own pieces (the scheduler's plan, the launch, the wait for the step in flight and its read-back, the scheduler's
update, the output path, the cost model's learning, the chooser's preparation) so that two variants' steps at the
same batch and k can be set side by side part by part. Inner parts (the chooser inside the schedule, the output
path inside emit, the runner's uniform launch and its pieces, its read-back) are shown in parentheses, not added
again. A part costs two perf_counter calls a call (~0.2 us). Every PROBE_EVERY-th step is followed by a probe of the
core's own speed (core_probe, about 10 us, counted in the next step's lap in every variant alike): where a variant's
steps run slower part by part but its probes do not, the core was not the slower, its work was.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

from common import Table, time_in_place
from mtpserve.cluster.engine import LLMEngine

# (part, owner's path on the engine, attribute): the top-level parts of a step, in the order a step runs them.
TOP_PARTS = (
    ("schedule", "scheduler", "schedule"),
    ("schedule", "scheduler", "schedule_overlapped"),
    ("launch", "executor", "submit"),
    ("launch", "executor", "execute"),
    ("prepare", "adaptive", "prepare_due"),
    ("wait", "executor", "wait"),
    ("update", "scheduler", "update"),
    ("emit", "", "_emit"),
    ("learn", "", "_learn_cost"),
)
# Parts inside a top-level one (reported apart, not added to the total).
INNER_PARTS = (("choose", "scheduler", "_choose_k"), ("detok", "outputs", "process"),
               ("uniform", "executor.runner", "_launch_uniform"), ("finish", "executor.runner", "_finish_uniform"),
               # inside the uniform launch: the batch's slots, the state diffs packed, their upload and scatter, the
               # result's copy to the host queued (the rest is the graph's lookup, input copy and replay); upload, apply
               # and stage also run in prefill and general-path steps, which the parts tables leave out
               ("batch", "executor.runner.batches", "of"), ("pack", "executor.runner.diffs", "pack"),
               ("upload", "executor.runner.uniform.staging", "upload"),
               ("apply", "executor.runner.uniform.state", "apply"), ("stage", "executor.runner", "_stage"))
INNER = tuple(part for part, _, _ in INNER_PARTS)
PROBE_EVERY = 8  # steps between two probes of the core's own speed (core_probe), run after a step
NAMES = ("schedule", "launch", "prepare", "wait", "update", "emit", "learn")


class HostParts:
    """Per LLMEngine.step call, the seconds spent in each part (TOP_PARTS, INNER_PARTS) and the call's own."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[dict[str, float]] = []
        self._now: dict[str, float] = {}
        for part, owner, name in TOP_PARTS + INNER_PARTS:
            time_in_place(_owner(engine, owner), name, partial(self._add, part))
        step = engine.step

        def traced_step() -> Any:
            self._now = {}
            t0 = time.perf_counter()
            out = step()
            self._now["step"] = time.perf_counter() - t0
            if len(self.steps) % PROBE_EVERY == 0:
                self._now["probe"] = core_probe()
            self.steps.append(self._now)
            self._now = {}  # a wrapped call outside a step (a warm-up's) adds to no recorded step
            return out

        engine.step = traced_step

    def _add(self, part: str, seconds: float) -> None:
        self._now[part] = self._now.get(part, 0.0) + seconds

    def start(self) -> None:
        self.steps = []


def core_probe() -> float:
    """Seconds of a fixed piece of plain Python (about 10 us) that touches none of the engine's data: set beside a
    variant's steps, it says whether the core itself ran slower in that variant's cells (its clock, a neighbour) or
    only the engine's own code did (what it reads and where that lies)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(400):
        total += i * i
    return time.perf_counter() - t0


def _owner(engine: LLMEngine, path: str) -> Any:
    """The object at a dotted attribute path from the engine ("": the engine; None where a link is missing)."""
    target: Any = engine
    for name in filter(None, path.split(".")):
        target = getattr(target, name, None)
    return target


def part_means(steps: list[dict[str, float]]) -> list[float]:
    """Mean microseconds a step of each of NAMES, 'other' (the step call less its parts), then of INNER."""
    def mean(name: str) -> float:
        return statistics.fmean(s.get(name, 0.0) for s in steps) * 1e6
    other = statistics.fmean(s["step"] - sum(s.get(n, 0.0) for n in NAMES) for s in steps) * 1e6
    return [mean(n) for n in NAMES] + [other] + [mean(n) for n in INNER]


def parts_table(title: str, rows: dict[str, tuple[float, list[dict[str, float]]]]) -> Table:
    """rows: per variant (its laps' mean seconds, its steps' parts; a step may also carry 'gc', seconds of garbage
    collection inside it, 'faults', minor page faults, and 'probe', a core_probe's seconds after it: what slows every
    part of a step alike)."""
    t = Table(title, ["variant", "steps", "lap us", "step() us", *NAMES, "other", *(f"({n})" for n in INNER),
                      "gc us", "faults", "probe us"])
    for name, (lap, steps) in rows.items():
        if steps:
            t.add(name, str(len(steps)), f"{lap * 1e6:.0f}",
                  f"{statistics.fmean(s['step'] for s in steps) * 1e6:.0f}",
                  *(f"{x:.0f}" for x in part_means(steps)),
                  f"{statistics.fmean(s.get('gc', 0.0) for s in steps) * 1e6:.1f}",
                  f"{statistics.fmean(s.get('faults', 0.0) for s in steps):.2f}",
                  _probe_cell([s["probe"] for s in steps if "probe" in s]))
    return t


def _probe_cell(probes: list[float]) -> str:
    """The median probe in us (a median: a probe the OS interrupts runs many times over), "-" where none ran."""
    return f"{statistics.median(probes) * 1e6:.2f}" if probes else "-"
