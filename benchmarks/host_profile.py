#!/usr/bin/env python
"""Where the host spends a step: cProfile of LLMEngine.step on the default model (or --model).

    python benchmarks/host_profile.py --k 0 --concurrency 1       # GPU if any
    python benchmarks/host_profile.py --device cpu --k 3 --concurrency 16

Requests of --max-tokens tokens (eos ignored) run in a closed loop (--concurrency in flight, a finished one
replaced at once, --requests in all), once to warm up (graph capture, Triton compilation), then under the
profiler. Prints ms per step and
the functions with the most time of their own; on a GPU the time the host waits for the device shows
as the result copy (`tolist`) inside the runner.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--requests", type=int, default=0, help="requests in all (closed loop); default: concurrency")
    p.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, num_speculative_tokens=args.k,
                                    max_num_seqs=max(args.concurrency, 1)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)

    def run(tag: str) -> int:
        """A closed loop: `concurrency` requests in flight, a finished one replaced at once, --requests in all."""
        total = max(args.requests, args.concurrency)
        added = 0
        for _ in range(args.concurrency):
            engine.add_request(f"{tag}{added}", f"def f{added}(n):\n    ", params)
            added += 1
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and added < total:
                    engine.add_request(f"{tag}{added}", f"def f{added}(n):\n    ", params)
                    added += 1
            steps += 1
        return steps

    run("warm")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = run("timed")
    prof.disable()
    wall = time.perf_counter() - t0
    total = max(args.requests, args.concurrency)
    print(f"k={args.k} concurrency={args.concurrency} requests={total}: {steps} steps, {wall / steps * 1e3:.3f} "
          f"ms/step (under the profiler), {total * args.max_tokens / wall:.0f} tok/s")
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
