#!/usr/bin/env python
"""Host time of adaptive speculation per step (docs/design.md §9): choosing the step's k for a batch of
running requests, learning from a step's accepted counts, and recording its time. The issue budgets
"well under 50 us per step for 256 requests" for the choice.

    python benchmarks/chooser_overhead.py [--requests 1,8,32,128,256] [--max-k 4] [--steps 3000]

It drives mtpserve.cluster.spec_chooser.AdaptiveSpec directly, as the scheduler does every step:
choose for the running requests' rows (Scheduler._choose_k gathers them from the Request objects only
when the running set changed: "gather"); after the step observe (AcceptanceTable.observe) and the
cost update (StepCosts.observe). "observe" is per step with the fold the chooser makes once per dwell
(AcceptanceTable.flush every 8 queued steps, min_dwell) spread over the steps it covers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.cluster.spec_chooser import AdaptiveConfig, AdaptiveSpec  # noqa: E402

CPU = torch.device("cpu")
DWELL = AdaptiveConfig.min_dwell


class _Req:  # the one Request field the scheduler reads per running request
    def __init__(self, row: int) -> None:
        self.spec_row = row


def _us(fn, steps: int) -> tuple[float, float]:
    us = np.array(common.time_ms(fn, CPU, min(200, steps), steps)) * 1e3
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def _observe_dwell(spec: AdaptiveSpec, rows: np.ndarray, drafts: np.ndarray, accepted: np.ndarray) -> None:
    """A dwell's steps of observations, then their fold (as the chooser makes it)."""
    for _ in range(DWELL):
        spec.acceptance.observe(rows, drafts, accepted)
    spec.acceptance.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--requests", default="1,8,32,128,256")
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    table = Table("adaptive speculation: host time per step (us, p50 / p99)",
                  ["requests", "choose p50", "choose p99", "gather p50", "gather p99", "observe p50", "observe p99",
                   "cost p50", "cost p99"])
    rng = np.random.default_rng(0)
    for n in common.parse_ints(args.requests):
        # min_dwell 0: every call makes the full choice (the engine makes it once per DWELL steps).
        spec = AdaptiveSpec(AdaptiveConfig(max_k=args.max_k, max_rows=max(n, 1), min_dwell=0))
        running = [_Req(spec.admit(args.max_k, i % 5 != 0)) for i in range(n)]  # a fifth with a fixed k
        drafts = np.full(n, args.max_k)
        accepted = rng.integers(0, args.max_k + 1, n)

        def gather() -> np.ndarray:
            return np.fromiter((r.spec_row for r in running), dtype=np.int64, count=len(running))

        rows = gather()
        c = _us(lambda: spec.choose(rows), args.steps)
        g = _us(gather, args.steps)
        o = _us(lambda: _observe_dwell(spec, rows, drafts, accepted), args.steps // DWELL)
        o = (o[0] / DWELL, o[1] / DWELL)
        k = _us(lambda: spec.costs.observe(n, 2, 0.01), args.steps)  # the estimate itself waits for choose
        table.add(str(n), *c, *g, *o, *k)
    common.report(args, "chooser_overhead", CPU, [table],
                  ["host only (numpy), on whatever else the machine runs meanwhile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
