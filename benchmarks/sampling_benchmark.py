#!/usr/bin/env python
"""Top-p filtering (issue 10): the full-vocabulary sort that to_probs used before (the reference,
copied inline here) against to_probs' threshold (sampling._top_p_threshold: a bisection at vocabularies
of sampling.BISECT_MIN_VOCAB and more off CUDA, a sort of the probabilities elsewhere), and against the
bisection forced everywhere, in one run.

    python benchmarks/sampling_benchmark.py [--device cpu|cuda] [--batch 1,8,32,128] [--vocab 151936] [--iters 20]

Both sides start from the same float32 logits and do the same softmax and renormalisation, so the ratio
is the filter's; "softmax only" is to_probs with top-p off, the part neither method can avoid. Each row
gets a top_p in [0.5, 0.99). On CUDA each call is captured in a CUDA graph (as the engine's steps run it)
and the replays are timed with CUDA events; elsewhere eager calls with perf_counter. Checks first that
both keep the same tokens, except in rows where float rounding decides: the two sum the same
probabilities in different orders, so where the mass before the crossing token lies within 1e-5 of
top_p either answer is the rule's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.workers import sampling  # noqa: E402
from mtpserve.workers.sampling import SamplingTensors, to_probs  # noqa: E402


def sort_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: to_probs' former top-p path (softmax, full sort, cumsum, scatter back)."""
    probs = logits.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def top_p_settings(top_p: torch.Tensor) -> SamplingTensors:
    """Rows [B] with only top-p on."""
    b, dev = top_p.shape[0], top_p.device
    ones, zeros = torch.ones(b, device=dev), torch.zeros(b, device=dev)
    return SamplingTensors(
        temperature=ones, top_k=torch.zeros(b, dtype=torch.long, device=dev), top_p=top_p, min_p=zeros,
        repetition=ones, presence=zeros, frequency=zeros, greedy=torch.zeros(b, dtype=torch.bool, device=dev),
        seed=torch.zeros(b, dtype=torch.long, device=dev), use_penalties=False, use_top_k=False, use_top_p=True,
        use_min_p=False, all_greedy=False)


def check_same_tokens(logits: torch.Tensor, st: SamplingTensors, batch: int) -> int:
    """Both keep the same tokens outside rounding-boundary rows; -> the number of boundary rows that differ."""
    ref, new = sort_top_p(logits, st.top_p) > 0, to_probs(logits, st) > 0
    differ = (ref != new).any(-1)
    probs = logits.softmax(-1)
    smaller = torch.minimum((probs * ref).sum(-1), (probs * new).sum(-1))
    common.check(bool(((smaller - st.top_p).abs() < 1e-5)[differ].all()),
                 f"batch {batch}: the threshold kept other tokens than the sort, away from the rounding boundary")
    return int(differ.sum())


def bisected(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """to_probs with the threshold found by bisection whatever the vocabulary and device."""
    saved = sampling.BISECT_MIN_VOCAB, sampling.BISECT_ON_CUDA
    sampling.BISECT_MIN_VOCAB, sampling.BISECT_ON_CUDA = 0, True
    try:
        return to_probs(logits, st)
    finally:
        sampling.BISECT_MIN_VOCAB, sampling.BISECT_ON_CUDA = saved


def graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """On CUDA, fn captured once in a CUDA graph (its replay is what a step pays); elsewhere fn itself."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--batch", default="1,8,32,128", help="rows per call, comma-separated")
    p.add_argument("--vocab", type=int, default=151936)
    common.add_timing_args(p)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, batch="1,8", vocab=4096, iters=5)
    device = common.pick_device(args.device, args.tiny)
    table = Table(f"top-p over a {args.vocab}-token vocabulary (ms per call, median of {args.iters})",
                  ["batch", "sort ms", "threshold ms", "ratio", "bisection ms", "softmax only ms"])
    gen = torch.Generator().manual_seed(0)
    boundary = 0
    for b in common.parse_ints(args.batch):
        logits = (torch.randn(b, args.vocab, generator=gen) * 3).to(device)
        st = top_p_settings((0.5 + 0.49 * torch.rand(b, generator=gen)).to(device))
        boundary += check_same_tokens(logits, st, b)
        times = [common.median(common.time_ms(graphed(fn, device), device, args.warmup, args.iters)) for fn in (
            lambda: sort_top_p(logits, st.top_p), lambda: to_probs(logits, st), lambda: bisected(logits, st),
            lambda: to_probs(logits, replace(st, use_top_p=False)))]
        table.add(str(b), times[0], times[1], f"{times[0] / times[1]:.2f}x", times[2], times[3])
    how = "CUDA-graph replays" if device.type == "cuda" else "eager calls"
    common.report(args, "sampling_benchmark", device, [table], [
        f"device: {common.device_name(device)}", f"timed: {how}",
        "ratio: sort ms / threshold ms (> 1: the threshold is faster)",
        f"rows where rounding at the crossing made the two keep different tokens: {boundary}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
