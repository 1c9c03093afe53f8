#!/usr/bin/env python
"""Kernels and device time of each captured uniform-step graph (CUDA only; a diagnosis aid, no RESULTS section).

    python benchmarks/graph_kernels.py [--model PATH] [--max-num-seqs 8] [--batches 1,8] [--diff-k 3]

On small models a step's device time is mostly one or two microseconds per kernel, so the kernel count
of a graph is what to cut. Prints, per greedy steady-state graph (window = 1 + k), the replay time, the
kernels per replay and their summed device time, and the host time of one `replay()` call with the
device idle and with the call queued behind earlier replays (a launch that blocks shows the second
near the device time); then which kernels the k = --diff-k graph has beyond the k = 0 one, at the
first batch.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.workers.graph_timing import time_start_graphs  # noqa: E402
from mtpserve.workers.uniform_graphs import UniformGraphs  # noqa: E402


def kernels_of(replay, times: int = 5) -> tuple[collections.Counter, float]:
    """(kernel name -> launches per replay x times, device microseconds per replay)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return collections.Counter(e.name[:80] for e in events), sum(e.device_time for e in events) / times


def launch_us(replay, times: int = 50) -> tuple[float, float]:
    """Median host microseconds of one replay() call: (device idle before it, queued behind earlier ones)."""
    idle, queued = [], []
    for _ in range(times):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        idle.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    for _ in range(times):
        t0 = time.perf_counter()
        replay()
        queued.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(idle) * 1e6, statistics.median(queued) * 1e6


def report(uniform: UniformGraphs, batches: list[int], diff_k: int) -> None:
    for batch, k, greedy, seconds in sorted(time_start_graphs(uniform, replays=20)):
        if batch in batches:
            print(f"graph batch {batch} k {k} {'greedy' if greedy else 'sampled'}: {seconds * 1e6:.1f} us per replay")
    counts: dict[tuple[int, int], collections.Counter] = {}
    graphs = [(batch, shape.chain, g) for (batch, shape), g in sorted(uniform.graphs.items(),
              key=lambda x: (x[0][0], x[0][1].chain))
              if batch in batches and shape.flags.all_greedy and shape.window == 1 + shape.chain]
    # Host launch times first: once the profiler has run, its hooks stay and make every launch slower.
    launches = {(batch, k): launch_us(g.graph.replay) for batch, k, g in graphs}
    for batch, k, g in graphs:
        names, device_us = kernels_of(g.graph.replay)
        counts[(batch, k)] = names
        idle_us, queued_us = launches[(batch, k)]
        print(f"batch {batch} k {k}: {sum(names.values()) / 5:.0f} kernels per replay, {device_us:.1f} us of "
              f"kernel time per replay; host per replay() {idle_us:.1f} us idle, {queued_us:.1f} us queued")
    first = batches[0]
    if (first, diff_k) in counts and (first, 0) in counts:
        print(f"\nbatch {first}: kernels per replay that k = {diff_k} has beyond k = 0")
        for name, n in (counts[(first, diff_k)] - counts[(first, 0)]).most_common(40):
            print(f"{n / 5:6.1f}  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded default model)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--diff-k", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("graph_kernels.py needs a CUDA GPU: it profiles captured CUDA graphs")
    with tempfile.TemporaryDirectory(prefix="mtpserve-graph-kernels-") as tmp:
        model = workloads.resolve_model(args.model, False, Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model), device="cuda", max_num_seqs=args.max_num_seqs))
        report(engine.executor.runner.uniform, [int(b) for b in args.batches.split(",")], args.diff_k)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
