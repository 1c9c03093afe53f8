#!/usr/bin/env python
"""The host's share of adaptive speculation: the engine over an executor that answers at once, no model.

    python benchmarks/host_only.py --concurrency 32,256 --rounds 8 [--free]

LLMEngine (scheduler, block manager, output processor, the chooser and its cost learning) runs a closed loop
of --concurrency requests as spec_matrix.py does, but its executor samples each step's result from a
per-position acceptance (--acceptance) instead of running a model: the steps cost the host alone, which is
where a host-bound step spends its time (c >= 32 on the H100). Each round times a fixed-k cell and an "auto"
cell back to back (their order alternating). Auto's chooser runs in full (choices, dwell, probes, cost
learning), but by default every step then runs --k: the two cells do the same steps, and auto / fixed k is
what auto's bookkeeping costs the host at the same k (on the H200 at c = 256, auto made 0.88-0.91 of fixed
k = 4's tok/s at the same k, run 231). --free lets auto's choices stand. A diagnosis aid: CPU only.

--catch-up-us X makes each step spend X us per position its catch-ups rewind (StepPlan.catch_up_tokens), the device
time a rise of k past lagging modules costs and the cost model never prices; the table counts the positions each auto
cell rewound. With it (5 us, c = 256, --k 3 --free, T = 1-like acceptance, 2 us a draft) the returns from auto's
probes below the modules and its rises in drains (from a k = 2 its newcomers took) caught up 14-148 thousand positions
in some cells (session AJ, docs/adaptive-measurements.md): run 318's failure on the H200, on the CPU. Those counts
were the scheduler's, from each request's first fall; the workers rewind per module, and since session AK so does the
count. Charged per module, auto made about 0.93 of fixed k = 3 there with or without that change.

--host-per-draft-us X makes each step's host spend X us more per draft (in the scheduler's update), a price a
window of one k cannot show. With --free, 10 us, T = 1-like acceptance (0.66,0.69,0.71,0.5) and c = 8, fixed k = 1
ran about 20 % faster than k = 3. Cell by cell against it, auto made 0.70-0.80 over 14 cells, at k = 4 and then
k = 3 (session AE). It drew the price of a draft past the MTP modules from its probes (10-12 us), never the one
below them. Since session AG auto also probes within the modules until five probes have drawn that price
(docs/adaptive-measurements.md): it made 0.71-0.83 of fixed k = 1 in the first four cells and 0.76-1.15 in the six
after (two runs of ten).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import workloads  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.boundary.messages import StepPlan, StepResult  # noqa: E402
from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.cluster.spec_chooser import AdaptiveSpec  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402

TOKENS = (1000, 2000)  # ids the sampled tokens and prompts are drawn from (ordinary text ids of the default model)


class InstantExecutor:
    """Answers a plan at once: a request that reaches its frontier accepts each draft with the position's
    conditional probability and samples one more token; nothing runs on any device."""

    def __init__(self, acceptance: list[float], seed: int = 0, catch_up_seconds: float = 0.0) -> None:
        self.acceptance, self.rng = acceptance, np.random.default_rng(seed)
        self.catch_up_seconds = catch_up_seconds  # spent (busy) per position a step's catch-ups rewind
        self.caught_up = 0  # positions the steps' catch-ups rewound, summed
        self.known: dict[str, int] = {}  # tokens the request has (prompt + output)
        self.computed: dict[str, int] = {}  # of them, positions fed so far

    def execute(self, plan: StepPlan) -> StepResult:
        self.caught_up += plan.catch_up_tokens
        until = time.perf_counter() + self.catch_up_seconds * plan.catch_up_tokens
        while time.perf_counter() < until:  # the device's share of a catch-up, which the cost model never prices
            pass
        for rid in plan.freed_ids:
            self.known.pop(rid, None)
            self.computed.pop(rid, None)
        for new in plan.new_requests:
            self.known[new.request_id] = len(new.token_ids)
            self.computed[new.request_id] = new.num_computed[0] if new.num_computed else 0
        out = StepResult()
        for rid, n, drafts in zip(plan.req_ids, plan.num_tokens, plan.num_drafts):
            self.computed[rid] += n
            if self.computed[rid] < self.known[rid]:
                continue  # mid-prompt: nothing sampled
            accepted = 0
            while accepted < drafts and self.rng.random() < self.acceptance[min(accepted, len(self.acceptance) - 1)]:
                accepted += 1
            out.req_ids.append(rid)
            out.token_ids.append(self.rng.integers(*TOKENS, accepted + 1).tolist())
            out.num_accepted.append(accepted)
            out.logprobs.append(None)
            self.known[rid] += accepted + 1
            self.computed[rid] = self.known[rid] - 1
        return out

    def shutdown(self) -> None:
        pass


FULL_CHOICES = [0]  # full choices the chooser made (a step whose call reset its dwell count)


def count_choices(pin: int | None) -> None:
    """Count the chooser's full choices; with `pin`, every auto step then runs that k after the chooser has
    made its choice as usual (its work stays, its k goes)."""
    choose = AdaptiveSpec.choose

    def counted(self: AdaptiveSpec, *args: Any, **kwargs: Any) -> int:
        k = choose(self, *args, **kwargs)
        FULL_CHOICES[0] += self.choosing
        if pin is not None:
            self.k = k = pin
        return k

    AdaptiveSpec.choose = counted  # type: ignore[method-assign]


def seed_every_k(engine: LLMEngine, seconds: float = 1e-6) -> None:
    """Device costs at every (bucket, k), as a GPU engine seeds them from its captured graphs at start: unseeded,
    the chooser's exploration of an untimed k - 1 made every one of a pinned cell's choices."""
    costs = engine.adaptive.costs
    for batch in costs.buckets.tolist():
        for k in range(costs.max_k + 1):
            for greedy in (True, False):
                costs.seed(batch, k, seconds, greedy)


def spend_per_draft(engine: LLMEngine, seconds: float) -> None:
    """Each step's host also spends `seconds` per draft it verified (busy, in the scheduler's update): a host price
    per draft that no window of one k shows, for the chooser to learn (docs/adaptive-measurements.md, AE and AG)."""
    update = engine.scheduler.update

    def spending(plan: StepPlan, result: StepResult, *rest: Any) -> Any:  # rest: update's clock, where timed
        until = time.perf_counter() + seconds * sum(plan.num_drafts)
        while time.perf_counter() < until:
            pass
        return update(plan, result, *rest)

    engine.scheduler.update = spending  # type: ignore[method-assign]


def cell(engine: LLMEngine, prompts: list[list[int]], k: int | str, c: int, max_tokens: int, name: str) -> float:
    jobs = [workloads.Job(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k))
            for p in prompts]
    return workloads.drive(engine, jobs, c, name).tokens_per_s


def measure(c: int, args: argparse.Namespace) -> tuple[list[float], list[float], list[int], list[int]]:
    """(fixed-k tok/s, auto tok/s, auto's full choices, the positions auto's catch-ups rewound) per round at
    concurrency c."""
    executor = InstantExecutor(args.acceptance, catch_up_seconds=args.catch_up_us * 1e-6)
    engine = LLMEngine(EngineConfig(device="cpu", max_num_seqs=c, num_kv_blocks=c * (args.max_tokens // 8 + 16)),
                       executor)
    seed_every_k(engine)
    if args.host_per_draft_us:
        spend_per_draft(engine, args.host_per_draft_us * 1e-6)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(*TOKENS, args.prompt_len).tolist() for _ in range(args.requests_per_slot * c)]
    for k in (args.k, "auto"):  # warm-up: the chooser's buckets and the cost lines see this batch first
        cell(engine, prompts, k, c, args.max_tokens, f"warm-{k}")
    fixed, auto, choices, caught_up = [], [], [], []
    for r in range(args.rounds):
        for k in ((args.k, "auto") if r % 2 == 0 else ("auto", args.k)):
            FULL_CHOICES[0], executor.caught_up = 0, 0
            (auto if k == "auto" else fixed).append(cell(engine, prompts, k, c, args.max_tokens, f"r{r}-{k}"))
            if k == "auto":
                choices.append(FULL_CHOICES[0])
                caught_up.append(executor.caught_up)
    return fixed, auto, choices, caught_up


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--concurrency", default="32,256")
    p.add_argument("--k", type=int, default=4, help="the fixed k (and, unless --free, the k auto's steps run)")
    p.add_argument("--free", action="store_true", help="auto's steps run the k it chooses")
    p.add_argument("--acceptance", default="0.84,0.89,0.93,0.9", help="conditional acceptance per draft position")
    p.add_argument("--host-per-draft-us", type=float, default=0.0, help="each step's host also spends this many us "
                   "per draft it verified (a host price per draft, which the chooser learns only from windows of two "
                   "k's; with --free)")
    p.add_argument("--catch-up-us", type=float, default=0.0, help="each step also spends this many us per position "
                   "its catch-ups rewind (what a rise of k past lagging modules costs the device)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency="4", rounds=2, max_tokens=16)
    args.acceptance = [float(a) for a in args.acceptance.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    count_choices(None if args.free else args.k)
    table = Table(f"host only: fixed k = {args.k} against auto{'' if args.free else f' (its steps at k = {args.k})'}",
                  ["conc", "fixed tok/s", "auto tok/s", "auto / fixed (median of rounds)", "per round",
                   "full choices per auto cell", "positions caught up per auto cell", "s"])
    for c in common.parse_ints(args.concurrency):
        t0 = time.perf_counter()
        fixed, auto, choices, caught_up = measure(c, args)
        ratios = [a / f for a, f in zip(auto, fixed)]
        table.add(str(c), float(np.median(fixed)), float(np.median(auto)), f"{np.median(ratios):.3f}",
                  " ".join(f"{r:.2f}" for r in ratios), " ".join(map(str, choices)), " ".join(map(str, caught_up)),
                  time.perf_counter() - t0)
    notes = ["device costs seeded at every (bucket, k) (1 us), as the GPU engine seeds them from its graphs",
             f"executor: none (InstantExecutor), acceptance per position {args.acceptance}, "
             f"host per draft {args.host_per_draft_us:g} us, catch-ups {args.catch_up_us:g} us a position, prompts of "
             f"{args.prompt_len} random ids, {args.max_tokens} tokens per request, {args.requests_per_slot} x conc "
             f"requests a cell; rounds alternate which cell runs first"]
    common.report(args, "host_only", common.pick_device("cpu", True), [table], notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
