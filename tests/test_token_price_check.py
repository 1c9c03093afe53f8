"""benchmarks/token_price_check.py: the token price drawn within steps, set beside tokens varied by design."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mtpserve.boundary.messages import StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import token_price_check  # noqa: E402


def test_each_step_draws_one_acceptance_for_every_request() -> None:
    executor = token_price_check.SwitchingExecutor(0.0, 1.0, seed=3)
    executor.known = {f"r{i}": 5 for i in range(16)}
    executor.computed = {f"r{i}": 4 for i in range(16)}
    accepted = []
    for _ in range(40):
        plan = StepPlan(req_ids=list(executor.known), num_tokens=[1] * 16, num_drafts=[3] * 16)
        accepted.append(set(executor.execute(plan).num_accepted))
    assert {0} in accepted and {3} in accepted and all(len(a) == 1 for a in accepted)


def test_the_fit_and_the_draw_come_out_of_a_small_closed_loop() -> None:
    args = token_price_check.parse_args(["--concurrency", "16", "--cells", "2", "--max-tokens", "96"])
    (now, after, level), drawn, steps = token_price_check.measure(16, args)
    assert steps > 40 and drawn is not None and drawn >= 0.0
    assert np.isfinite([now, after, level]).all() and level > 0.0
