#!/usr/bin/env python
"""Paged attention's one-pass and split-KV kernels at decode and verify shapes (CUDA only; a diagnosis aid,
no RESULTS section).

    python benchmarks/attention_kernels.py [--cases 64x1x1024,32x4x8192] [--heads 32 --kv-heads 8 --head-dim 128]

Per case (batch x window x context) it times the one-pass kernel with 32-, 64- and 128-position K/V tiles
and the split kernel at several split counts (with --stages and --warps, every such pair as well: "s3 w8" is
three K/V tiles in flight and eight warps a program), each as a CUDA graph of --calls calls cycling over --layers
layer caches (so that no call finds its KV in the L2, as in a step), and prints microseconds per call and
the share of the copy bandwidth that the KV bytes alone would take. `default` marks what the attention
backend picks for that shape (workers/attention.py). Session K's run 88 chose the one-pass tile from it
(paged_attention.one_pass_block_n).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from mtpserve.kernels.paged_attention import one_pass_block_n, paged_attention, shared_memory, sm_count  # noqa: E402
from mtpserve.kernels.paged_attention_split import num_splits_for, paged_attention_split  # noqa: E402

Attend = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (k_cache, v_cache) -> out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x1x1024,8x1x1024,32x1x1024,64x1x1024,32x4x1024,64x4x1024,"
                                      "1x1x8192,8x1x8192,32x1x8192,8x4x8192,32x4x8192",
                   help="batch x window x context, comma-separated")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="layer caches cycled through")
    p.add_argument("--calls", type=int, default=8, help="calls per timed graph")
    p.add_argument("--splits", default="2,3,4,8,16")
    p.add_argument("--stages", default="2", help="K/V tiles in flight per program, comma-separated")
    p.add_argument("--warps", default="", help="warps per program, comma-separated (0 or empty: the wrappers' own)")
    p.add_argument("--bandwidth-gb", type=float, default=2.0, help="size of the copy that measures bandwidth")
    return p.parse_args(argv)


def variants(q: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor, window: int,
             seq: int, splits: list[int], stages: list[int], warps: list[int | None]) -> dict[str, Attend]:
    """Every kernel configuration timed for one case (a suffix names stages and warps where several are swept)."""
    scale = q.shape[-1] ** -0.5
    out: dict[str, Attend] = {}
    for st in stages:
        for w in warps:
            tag = "" if stages == [2] and warps == [None] else f" s{st} w{w or 'default'}"  # the wrappers' own
            for bn in (32, 64, 128):
                out[f"one-pass bn{bn}{tag}"] = lambda k, v, bn=bn, st=st, w=w: paged_attention(
                    q, k, v, qsl, seq_lens, tables, window, seq, scale, block_n=bn, num_stages=st, num_warps=w)
            for s in splits:
                out[f"split {s}{tag}"] = lambda k, v, s=s, st=st, w=w: paged_attention_split(
                    q, k, v, qsl, seq_lens, tables, window, seq, scale, num_splits=s, num_stages=st, num_warps=w)
    return out


def graph_us(attend: Attend, caches: list[tuple[torch.Tensor, torch.Tensor]], calls: int) -> float:
    """Median microseconds per call over five replays of a graph of `calls` calls over the caches in turn."""
    for k, v in caches:
        attend(k, v)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            attend(*caches[i % len(caches)])
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def run_case(args: argparse.Namespace, batch: int, window: int, context: int, bandwidth: float) -> str:
    dev, seq = torch.device("cuda"), context + window
    blocks = -(-seq // args.page)
    shape = (batch * blocks, args.page, args.kv_heads, args.head_dim)
    caches = [tuple(torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(2)) for _ in range(args.layers)]
    tables = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
    tables = tables[torch.randperm(batch, device=dev)]  # requests' pages not in order
    q = torch.randn(batch * window, args.heads, args.head_dim, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, batch * window + 1, window, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq, device=dev, dtype=torch.int32)
    kv_bytes = 2 * batch * seq * args.kv_heads * args.head_dim * 2
    group = args.heads // args.kv_heads
    splits = num_splits_for(batch, args.kv_heads, window, seq, group, sm_count(dev))
    tile = one_pass_block_n(batch, args.kv_heads, args.head_dim, sm_count(dev), window, shared_memory(dev))
    default = f"split {splits}" if splits > 1 else f"one-pass bn{tile}"
    stages = common.parse_ints(args.stages)
    warps = [w or None for w in common.parse_ints(args.warps)] if args.warps else [None]  # 0: the wrapper's
    if stages != [2] or warps != [None]:  # named with its pipelining: marked only where the sweep has it
        default += " s2 wdefault"
    cells = []
    for name, attend in variants(q, qsl, seq_lens, tables, window, seq, common.parse_ints(args.splits), stages,
                                 warps).items():
        try:
            us = graph_us(attend, caches, args.calls)
            mark = " (default)" if name == default else ""
            cells.append(f"{name}{mark} {us:.1f} us {kv_bytes / (us * 1e-6) / bandwidth * 100:.0f} %")
        except Exception as exc:  # e.g. shared memory on a smaller GPU: that configuration only
            cells.append(f"{name} failed ({type(exc).__name__})")
    return f"batch {batch} window {window} context {context}: " + "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU: it times compiled kernels in CUDA graphs")
    bandwidth = common.measure_bandwidth(torch.device("cuda"), int(args.bandwidth_gb * 1e9))
    print(f"{common.device_name(torch.device('cuda'))}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"% = KV bytes / time / that bandwidth")
    for case in args.cases.split(","):
        batch, window, context = (int(x) for x in case.split("x"))
        print(run_case(args, batch, window, context, bandwidth), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
