#!/usr/bin/env python
"""Host time of adaptive speculation (docs/design.md §9): the per-step share, and a full choice. The issue
budgets "well under 50 us per step for 256 requests".

    python benchmarks/chooser_overhead.py [--requests 1,8,32,128,256] [--max-k 4] [--steps 3000]

It drives mtpserve.cluster.spec_chooser.AdaptiveSpec directly, as the scheduler and the engine do: every
step the scheduler gathers the running requests' rows (only when the running set changed: "gather") and
asks for the step's k ("step": a dwell's k, held); after the step the acceptance table queues the accepted
counts and the step costs take the step's device and host seconds ("observe"). Once per dwell the chooser
makes a full choice ("full choice": folding the dwell's queued observations, the cost row at every k from
the host's line and the device's medians, the argmax). The costs are seeded at every k, as the GPU engine
seeds them from its captured graphs, and the steps alternate between two k with varying accepted counts,
so that the host line has slopes to draw.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.cluster.spec_chooser import AdaptiveSpec  # noqa: E402
from mtpserve.cluster.spec_config import AdaptiveConfig  # noqa: E402
from mtpserve.cluster.step_costs import StepCosts  # noqa: E402

CPU = torch.device("cpu")
DWELL = AdaptiveConfig.min_dwell


class _Req:  # the one Request field the scheduler reads per running request
    def __init__(self, row: int) -> None:
        self.spec_row = row


def _us(fn, steps: int) -> tuple[float, float]:
    us = np.array(common.time_ms(fn, CPU, min(200, steps), steps)) * 1e3
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


class _Load:
    """Steps as the engine reports them: the running requests' accepted counts and the step's timings (drawn
    ahead, so that timing `step` times the chooser's work alone)."""

    POOL = 256

    def __init__(self, spec: AdaptiveSpec, rows: np.ndarray, max_k: int, rng: np.random.Generator) -> None:
        self.spec, self.rows, self.steps = spec, rows, 0
        n = len(rows)
        self.ks = [max_k - i % 2 for i in range(self.POOL)]  # two k: the host line has a slope per draft
        accepted = [np.minimum(rng.geometric(0.35, n) - 1, k) for k in self.ks]
        self.seen = [list(zip(rows.tolist(), [k] * n, a.tolist())) for k, a in zip(self.ks, accepted)]
        self.tokens = [float(a.sum() + n) for a in accepted]
        self.device = [0.3e-3 * (1 + 0.1 * k) * rng.uniform(0.95, 1.05) for k in self.ks]
        self.host = [(0.1e-3 + 2e-6 * n + 3e-6 * t) * rng.uniform(0.9, 1.3) for t in self.tokens]

    def step(self) -> None:
        i, n = self.steps % self.POOL, len(self.rows)
        self.spec.acceptance.observe_step(self.seen[i])  # as the scheduler gathers a step's counts
        device, host = self.device[i], self.host[i]
        self.spec.costs.observe(n, self.ks[i], device, host, True, self.tokens[i], True, max(device, host) + 2e-5)
        self.steps += 1


def _full_choice_us(spec: AdaptiveSpec, load: _Load, times: int) -> tuple[float, float]:
    """p50 / p99 of a full choice made after a dwell's steps were observed (those untimed)."""
    us = []
    for _ in range(times):
        for _ in range(DWELL):
            load.step()
        spec._held = spec.dwell  # the dwell is over
        t0 = time.perf_counter()
        spec.choose(load.rows)
        us.append((time.perf_counter() - t0) * 1e6)
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--requests", default="1,8,32,128,256")
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    table = Table("adaptive speculation: host time (us, p50 / p99)",
                  ["requests", "full choice p50", "full choice p99", "step p50", "step p99", "gather p50",
                   "gather p99", "observe p50", "observe p99"])
    rng = np.random.default_rng(0)
    for n in common.parse_ints(args.requests):
        spec = AdaptiveSpec(AdaptiveConfig(max_k=args.max_k, max_rows=max(n, 1)))
        for k in range(args.max_k + 1):
            spec.costs.seed(n, k, 0.3e-3 * (1 + 0.1 * k))
        running = [_Req(spec.admit(args.max_k, i % 5 != 4)) for i in range(n)]  # a fifth with a fixed k

        def gather() -> np.ndarray:
            return np.fromiter((r.spec_row for r in running), dtype=np.int64, count=len(running))

        load = _Load(spec, gather(), args.max_k, rng)
        for _ in range(4 * StepCosts.HOST_WINDOW):  # full windows of host samples
            load.step()
        spec.choose(load.rows)
        full = _full_choice_us(spec, load, max(args.steps // DWELL, 20))
        spec.dwell, spec._held = 10**9, 0  # a choice that holds: what every other step pays
        held = _us(lambda: spec.choose(load.rows), args.steps)
        table.add(str(n), *full, *held, *_us(gather, args.steps), *_us(load.step, args.steps))
    common.report(args, "chooser_overhead", CPU, [table],
                  ["host only (numpy), on whatever else the machine runs meanwhile; observe = the acceptance "
                   "table's queueing and the step costs' update of one step"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
