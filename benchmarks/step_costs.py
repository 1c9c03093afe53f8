#!/usr/bin/env python
"""What adaptive speculation learns a step costs, against what the steps cost (docs/design.md §9).

    python benchmarks/step_costs.py [--ks 0,2,4,auto,0,4] [--concurrency 1,8] [--model PATH] [--device cuda]

For each (concurrency, k) cell, in the order given (a k may repeat: the host's speed drifts, and a
repeat shows by how much), the closed loop of spec_matrix.py runs once on one engine, and it prints
the wall time per engine step, the samples the engine fed StepCosts per k (count; median, p10 and p90
of the device's share and of the host's) and, at the end of the cell, the chooser's cost row for that
batch size, its host share now and its device row. Where the cost row and the fixed-k cells disagree,
the chooser picks k's that the fixed cells beat (the H100, session F, from whole-lap medians: auto's
k = 4 read 4.4x k = 0 where steps were 1.4x). A diagnosis aid: no RESULTS section.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import host  # noqa: E402
import workloads  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.cluster.step_costs import StepCosts  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402


class LapRecorder:
    """The samples StepCosts.observe receives, per k (wrapped on the class: every engine's table)."""

    def __init__(self) -> None:
        self.samples: dict[int, list[tuple[float, float, float]]] = {}  # k -> (device, host, lap) per sample
        self.overlapped = False
        observe = StepCosts.observe

        def recorded(costs: StepCosts, batch: int, k: int, device: float, host: float = 0.0,
                     overlapped: bool = False, tokens: float = 0.0, greedy: bool = True, lap: float = 0.0) -> None:
            self.samples.setdefault(k, []).append((device, host, lap))
            self.overlapped = overlapped
            observe(costs, batch, k, device, host, overlapped, tokens, greedy, lap)

        StepCosts.observe = recorded

    def summary(self) -> dict[int, str]:
        """k -> 'n; device, host and lap median/p10/p90' (ms)."""
        def ms(v: np.ndarray) -> str:
            return "/".join(f"{float(np.percentile(v, q)) * 1e3:.3f}" for q in (50, 10, 90))
        return {k: f"{len(v)}; device {ms(np.array(v)[:, 0])}; host {ms(np.array(v)[:, 1])}; lap {ms(np.array(v)[:, 2])}"
                for k, v in sorted(self.samples.items())}


def run_cell(engine: LLMEngine, laps: LapRecorder, k: int | str, c: int, prompts: list[str],
             args: argparse.Namespace) -> None:
    jobs = [workloads.Job(p, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                            ignore_eos=True, num_speculative_tokens=k))
            for p in prompts[: max(8, args.requests_per_slot * c)]]
    laps.samples.clear()
    t0 = time.perf_counter()
    run = workloads.drive(engine, jobs, c, f"k{k}c{c}")
    wall = time.perf_counter() - t0
    print(f"c={c} k={k}: {wall / run.engine_steps * 1e3:.3f} ms per step, {run.tokens_per_s:.0f} tok/s, "
          f"AL {run.spec.acceptance_length:.2f}; samples per k (ms: median/p10/p90) {laps.summary()}")
    costs, greedy = engine.adaptive.costs, args.temperature == 0
    print(f"  cost row (ms) {np.round(costs.costs(c, greedy=greedy) * 1e3, 3).tolist()} = "
          f"{'max' if laps.overlapped else 'sum'}(host now {_line(costs, c)}, "
          f"device {np.round(costs.device(c, greedy) * 1e3, 3).tolist()} + gap {costs.gap(c) * 1e3:.3f})")


def _line(costs: StepCosts, c: int) -> str:
    """The bucket's host share now, as printed: 'a + b/token ms + [price at k = 0..] us a request (median m)'."""
    a, b, median = costs.host_line(c)
    prices = ", ".join(f"{p * 1e6:.2f}" for p in costs.host_draft_prices(c))
    return f"{a * 1e3:.3f} + {b * 1e3:.4f}/token ms + [{prices}] us a request at k = 0.. (median {median * 1e3:.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded default model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--ks", default="0,2,4,auto,0,4", help="cells in order; 'auto' for adaptive speculation")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    host.add_pin_arg(p)
    args = p.parse_args(argv)
    device = common.pick_device(args.device)
    ks = common.parse_ks(args.ks)
    concurrency = common.parse_ints(args.concurrency)
    laps = LapRecorder()
    with tempfile.TemporaryDirectory(prefix="mtpserve-step-costs-") as tmp:
        model = workloads.resolve_model(args.model, False, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model), device=str(device), max_num_seqs=max(concurrency)))
        if engine.adaptive is None:
            sys.exit("this model has no MTP modules: there is no adaptive speculation to look at")
        modes = engine.adaptive.costs.modes
        greedy, sampled = (np.round(modes[g].seeds[0] * 1e3, 3).tolist() for g in (True, False))
        if device.type == "cuda":  # on the CPU the model's threads would inherit the one core
            print(host.pin_cpu(args.pin_cpu))
        print(f"async scheduling {engine._async}; start-up graph seeds (ms, first bucket): greedy {greedy}, "
              f"sampled {sampled}")
        prompts = workloads.get_prompts("stdlib", max(8, args.requests_per_slot * max(concurrency)), 2)
        for c in concurrency:
            for k in ks:
                run_cell(engine, laps, k, c, prompts, args)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
