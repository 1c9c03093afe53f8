#!/usr/bin/env python
"""Small-M GEMMs of an 8B step: F.linear (cuBLAS) against skinny_gemm, each as % of its weight-read floor.

    python benchmarks/gemm_benchmark.py --table-out skinny_table.json   # Llama-3-8B shapes, bf16, cuda
    python benchmarks/gemm_benchmark.py --tiny --device cpu             # tiny shapes, interpreted kernel

For every projection a step runs (fused qkv, o, fused gate/up, down, LM head, an MTP module's eh_proj)
and every M in --rows (a decode or verify batch's rows): the skinny config is picked per M bucket by
timing every candidate config (skinny_gemm.candidate_configs) at the bucket's largest M, then cuBLAS
and that config are timed at every M; each timing is one CUDA graph of --calls products cycling
through enough copies of the weight that none stays in the 50 MB L2 (a real step never finds a
weight there), so kernels run back to back as in a step's graph.
floor = (bytes of w + x + y) / bandwidth measured here by a large device-to-device copy, as
step_benchmark.py measures it. --table-out writes the winner per (device, dtype, M bucket, N, K), the
sum over the bucket's M rows, as JSON that MTPSERVE_SKINNY_TABLE (or step_benchmark --skinny-table)
loads. On CPU (--tiny) the kernel runs under TRITON_INTERPRET=1, eagerly: a smoke run of the script,
not a timing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table, check  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if TYPE_CHECKING:
    from mtpserve.kernels.skinny_gemm import SkinnyConfig

L2_FLUSH_BYTES = 256 << 20  # weight copies per graph add up to at least this: 5x an H100's L2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    common.add_llama8b_shape_args(p)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="M values (batch x window rows)")
    p.add_argument("--calls", type=int, default=24, help="products per timed graph")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="graph replays timed (median)")
    p.add_argument("--bandwidth-gb", type=float, default=4.0, help="size of the copy that measures bandwidth")
    p.add_argument("--table-out", type=Path, default=None, help="write the dispatch table (JSON) here")
    p.add_argument("--show-candidates", action="store_true", help="print every candidate config's time (a sweep)")
    p.add_argument("--cublaslt", action="store_true", help="also time F.linear with cuBLASLt preferred "
                   "(torch.backends.cuda.preferred_blas_library): a third candidate, not in the dispatch table")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                         rows="1,4,16,33", calls=2, warmup=1, iters=2, bandwidth_gb=0.05)
    return args


def shapes(a: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(projection, N, K) in nn.Linear layout, as mtpserve's models hold them (q/k/v and gate/up fused)."""
    return [("qkv", (a.heads + 2 * a.kv_heads) * a.head_dim, a.hidden), ("o", a.hidden, a.heads * a.head_dim),
            ("gate_up", 2 * a.intermediate, a.hidden), ("down", a.hidden, a.intermediate),
            ("lm_head", a.vocab, a.hidden), ("eh_proj", a.hidden, 2 * a.hidden)]


def per_call_us(fns: list[Callable[[], object]], device: torch.device, warmup: int, iters: int) -> float:
    """Median time of one call: all of fns in one CUDA graph (eager off CUDA), divided by their number."""
    run: Callable[[], object] = lambda: [f() for f in fns]  # noqa: E731
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    return common.median(common.time_ms(run, device, warmup, iters)) * 1e3 / len(fns)


def weight_copies(n: int, k: int, dtype: torch.dtype, device: torch.device, tiny: bool) -> list[torch.Tensor]:
    size = n * k * torch.finfo(dtype).bits // 8
    copies = 1 if tiny else max(1, math.ceil(L2_FLUSH_BYTES / size))
    return [torch.randn(n, k, device=device, dtype=dtype) / math.sqrt(k) for _ in range(copies)]


def over_copies(fn: Callable[[torch.Tensor], object], ws: list[torch.Tensor], calls: int) -> list[Callable[[], object]]:
    """`calls` (at least one per copy) products cycling through the weight copies."""
    return [lambda w=ws[i % len(ws)]: fn(w) for i in range(max(calls, len(ws)))]


def bucket_configs(xs: dict[int, torch.Tensor], ws: list[torch.Tensor], device: torch.device,
                   args: argparse.Namespace) -> dict[int, SkinnyConfig]:
    """M bucket -> the fastest candidate config at the bucket's largest M, timed as the rows are."""
    from mtpserve.kernels.skinny_gemm import candidate_configs, m_bucket, num_sms, skinny_gemm

    out = {}
    for m in sorted(xs, reverse=True):
        b, (n, k) = m_bucket(m), ws[0].shape
        if b in out:
            continue
        best = None
        for cfg in candidate_configs(m, n, k, num_sms(device)):
            try:  # a failing config fails in the eager warm-up run, before any capture
                us = per_call_us(over_copies(lambda w, c=cfg: skinny_gemm(xs[m], w, config=c), ws, args.calls),
                                 device, args.warmup, args.iters)
            except Exception as exc:  # e.g. OutOfResources (shared memory) on a smaller GPU
                print(f"config {cfg.as_list()} skipped for {(n, k)} at M={m}: {exc!r}")
                continue
            if args.show_candidates:
                print(f"  candidate N {n} K {k} M {m} {'x'.join(map(str, cfg.as_list()))}: {us:.1f} us")
            best = (us, cfg) if best is None or us < best[0] else best
        check(best is not None, f"no skinny config ran for {(n, k)} at M={m}")
        out[b] = best[1]
    return out


Times = tuple[float, float, float, str, float]  # cuBLAS us, skinny us, floor us, table key, cuBLASLt us (or inf)


def bench_shape(name: str, n: int, k: int, rows: list[int], bw: float, dtype: torch.dtype, device: torch.device,
                args: argparse.Namespace, table: Table, entries: dict) -> dict[int, Times]:
    """Rows of `table` and `entries` for one projection; -> M -> its Times (cuBLASLt's inf without --cublaslt)."""
    from mtpserve.kernels import linear_dispatch as dispatch
    from mtpserve.kernels.skinny_gemm import m_bucket, skinny_gemm
    from mtpserve.kernels.skinny_gemm_ref import skinny_gemm_ref

    ws = weight_copies(n, k, dtype, device, args.tiny)
    xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in rows}
    configs = bucket_configs(xs, ws, device, args)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    size = torch.finfo(dtype).bits // 8
    times = {}
    for m in rows:
        x, cfg = xs[m], configs[m_bucket(m)]
        out = skinny_gemm(x, ws[0], config=cfg)
        ref = skinny_gemm_ref(x, ws[0])
        check(torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item()),
              f"{name} M={m}: skinny_gemm disagrees with the reference")
        cublas = per_call_us(over_copies(lambda w: F.linear(x, w), ws, args.calls), device, args.warmup, args.iters)
        skinny = per_call_us(over_copies(lambda w: skinny_gemm(x, w, config=cfg), ws, args.calls), device,
                             args.warmup, args.iters)
        floor = (n * k + m * k + m * n) * size / bw * 1e6
        lt = cublaslt_us(x, ws, device, args) if args.cublaslt else math.inf
        table.add(name, str(n), str(k), str(m), cublas, f"{100 * floor / cublas:.0f}",
                  *([lt, f"{100 * floor / lt:.0f}"] if args.cublaslt else []), skinny,
                  f"{100 * floor / skinny:.0f}", "x".join(map(str, cfg.as_list())),
                  dispatch.Choice((), skinny, cublas, lt).route, cublas / skinny)
        key = dispatch.shape_key(dev_name, dtype, m_bucket(m), n, k)
        old = entries.get(key)
        entries[key] = dispatch.Choice(tuple(cfg.as_list()), skinny + (old.skinny_us if old else 0.0),
                                       cublas + (old.cublas_us if old else 0.0), lt + (old.cublaslt_us if old else 0.0))
        print(f"{name:8s} N {n:6d} K {k:5d} M {m:3d}: cuBLAS {cublas:8.1f} us  skinny {skinny:8.1f} us "
              f"({cfg.as_list()})  floor {floor:7.1f} us")
        times[m] = (cublas, skinny, floor, key, lt)
    del ws, xs
    return times


def cublaslt_us(x: torch.Tensor, ws: list[torch.Tensor], device: torch.device, args: argparse.Namespace) -> float:
    """F.linear's time per call with cuBLASLt preferred (on the H200, run 266: the down projection at 32-64 rows
    88 % of its bytes against cuBLAS's 77-81 %, o at 32 rows 68 % against 57 %; the same from 128 rows)."""
    from mtpserve.kernels.linear_dispatch import cublaslt

    with cublaslt():
        return per_call_us(over_copies(lambda w: F.linear(x, w), ws, args.calls), device, args.warmup, args.iters)


def layer_table(times: dict[str, dict[int, Times]], entries: dict, rows: list[int]) -> Table:
    """One decoder layer's four GEMMs (qkv, o, gate_up, down) per M: cuBLAS, skinny, and what auto would run (with
    --cublaslt, cuBLASLt where the table's route is it)."""
    t = Table("one decoder layer's GEMMs (qkv + o + gate_up + down): us and % of their floor; auto = per "
              "projection and M bucket, the table's winner", ["M", "cuBLAS us", "%floor", "skinny us", "%floor",
                                                              "auto us", "%floor"])
    for m in rows:
        parts = [times[name][m] for name in ("qkv", "o", "gate_up", "down")]
        cublas, skinny, floor = (sum(p[i] for p in parts) for i in range(3))
        auto = sum({"skinny": p[1], "cublaslt": p[4]}.get(entries[p[3]].route, p[0]) for p in parts)
        t.add(str(m), cublas, f"{100 * floor / cublas:.0f}", skinny, f"{100 * floor / skinny:.0f}", auto,
              f"{100 * floor / auto:.0f}")
    return t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    if device.type != "cuda":  # the kernel runs interpreted; triton must see this before its first import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = sorted(set(common.parse_ints(args.rows)))
    from mtpserve.kernels import linear_dispatch as dispatch
    from mtpserve.kernels.skinny_gemm import MAX_ROWS

    check(rows and 0 < rows[0] and rows[-1] <= MAX_ROWS, f"--rows must lie in 1..{MAX_ROWS}")
    torch.manual_seed(0)
    bw = common.measure_bandwidth(device, int(args.bandwidth_gb * 1e9))
    print(f"device {common.device_name(device)}; copy bandwidth {bw / 1e12:.3f} TB/s; {dtype}")
    table = Table(f"small-M GEMMs, {dtype}, % of floor = (w + x + y bytes) / {bw / 1e12:.2f} TB/s (copy)",
                  ["proj", "N", "K", "M", "cuBLAS us", "cuBLAS %floor",
                   *(["cuBLASLt us", "cuBLASLt %floor"] if args.cublaslt else []), "skinny us", "skinny %floor",
                   "config (bn x bk x split x warps x stages x fused sum)", "winner", "cuBLAS/skinny"])
    entries: dict = {}
    times = {name: bench_shape(name, n, k, rows, bw, dtype, device, args, table, entries)
             for name, n, k in shapes(args)}
    wins = sum(c.route != "cublas" for c in entries.values())
    if args.table_out is not None:
        dispatch.save_table(args.table_out, entries)
        print(f"dispatch table: {len(entries)} (shape, M bucket) entries, skinny or cuBLASLt wins {wins}: "
              f"{args.table_out}")
    notes = [f"shapes: hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
             f"intermediate {args.intermediate}, vocab {args.vocab} (qkv and gate/up fused, as the models hold them)",
             f"per-call time = median of {args.iters} replays of one CUDA graph of {args.calls}+ products cycling "
             f"through weight copies of >= {L2_FLUSH_BYTES >> 20} MB in all (no L2 reuse); CPU: eager, interpreted",
             "skinny config per M bucket (16/32/64/128/256): the fastest of skinny_gemm.candidate_configs at the "
             "bucket's largest M, timed the same way; the table's winner per bucket compares the sums over its rows",
             f"dispatch table: skinny or cuBLASLt wins {wins} of {len(entries)} (shape, M bucket) entries"]
    common.report(args, "gemm_benchmark", device, [table, layer_table(times, entries, rows)], notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
