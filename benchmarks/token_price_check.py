#!/usr/bin/env python
"""The host's price of a token drawn within steps (mtpserve/cluster/token_price.py) against tokens varied by design.

    python benchmarks/token_price_check.py --concurrency 64,128 --cells 3

The engine runs host_only.py's closed loop at a fixed k (no model: its executor samples each step's accepted drafts),
but every step draws one acceptance for all its requests at random (--acceptance-low or --acceptance-high), so the
tokens a step emits vary independently of the host's drift. Over the full-batch steps, a least-squares fit of the
host's share per request on the tokens per request of the step and of the step before gives the whole marginal price
of a token on the host: the part the step that emits them pays (postprocessing, which the within-step draws time) and
the part the next step pays (its schedule: KV blocks allocated as requests cross them). Set beside it: the price the
engine drew within its own steps. CPU only: a diagnosis aid for the cost model (docs/adaptive-measurements.md, AM).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import host_only  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.boundary.messages import StepPlan, StepResult  # noqa: E402
from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402


class SwitchingExecutor(host_only.InstantExecutor):
    """host_only's executor with one acceptance per step for every position and request, low or high at random."""

    def __init__(self, low: float, high: float, seed: int = 0) -> None:
        super().__init__([low], seed)
        self.levels = (low, high)

    def execute(self, plan: StepPlan) -> StepResult:
        self.acceptance = [self.levels[int(self.rng.random() < 0.5)]]
        return super().execute(plan)


def measure(c: int, args: argparse.Namespace) -> tuple[list[float], float | None, int]:
    """([b this step, b step before, level] in seconds per request, the price drawn within steps, full-batch steps)."""
    engine = LLMEngine(EngineConfig(device="cpu", max_num_seqs=c, num_kv_blocks=c * (args.max_tokens // 8 + 16)),
                       SwitchingExecutor(args.acceptance_low, args.acceptance_high, args.seed))
    host_only.seed_every_k(engine)
    costs, samples = engine.adaptive.costs, []
    observe = costs.observe

    def traced(batch: int, k: int, device: float, host: float = 0.0, overlapped: bool = False, tokens: float = 0.0,
               greedy: bool = True, lap: float = 0.0) -> None:
        if batch == c:
            samples.append((host / batch, tokens / batch))
        observe(batch, k, device, host, overlapped, tokens, greedy, lap)

    costs.observe = traced  # type: ignore[method-assign]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(*host_only.TOKENS, args.prompt_len).tolist() for _ in range(2 * c)]
    for cell in range(args.cells):
        host_only.cell(engine, prompts, args.k, c, args.max_tokens, f"cell-{cell}")
    host, tokens = np.array(samples).T
    fit = np.column_stack((tokens[1:], tokens[:-1], np.ones(len(tokens) - 1)))
    kept = host[1:] < 2.0 * np.median(host[1:])  # a GC pause, the OS
    coef = np.linalg.lstsq(fit[kept], host[1:][kept], rcond=None)[0].tolist()
    return coef, costs.tokens.price, len(samples)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--concurrency", default="64,128")
    p.add_argument("--k", type=int, default=4, help="every request's fixed k")
    p.add_argument("--acceptance-low", type=float, default=0.15)
    p.add_argument("--acceptance-high", type=float, default=0.95)
    p.add_argument("--cells", type=int, default=3, help="cells of 2 x conc requests, one engine")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency="8", cells=1, max_tokens=64)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    table = Table("the host's price of a token (us per request): within steps, against tokens varied by design",
                  ["conc", "full steps", "drawn within steps", "this step's", "the next step's", "in all",
                   "level", "s"])
    for c in common.parse_ints(args.concurrency):
        t0 = time.perf_counter()
        (now, after, level), drawn, steps = measure(c, args)
        table.add(str(c), steps, "-" if drawn is None else f"{drawn * 1e6:.2f}", f"{now * 1e6:.2f}",
                  f"{after * 1e6:.2f}", f"{(now + after) * 1e6:.2f}", f"{level * 1e6:.2f}", time.perf_counter() - t0)
    notes = [f"executor: none (InstantExecutor), every step's acceptance {args.acceptance_low} or "
             f"{args.acceptance_high} at random for every request and position, fixed k = {args.k}, prompts of "
             f"{args.prompt_len} random ids, {args.max_tokens} tokens per request, {args.cells} cells of 2 x conc "
             "requests; this step's, the next step's: least squares of the host's share per request on the tokens "
             "per request of the step and of the step before, over the full-batch steps"]
    common.report(args, "token_price_check", common.pick_device("cpu", True), [table], notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
