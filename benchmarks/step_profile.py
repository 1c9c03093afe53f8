"""Profile tables of step_benchmark.py: one verify step's top kernels, and the kernels one draft position adds."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import common
from common import Table
import torch

from mtpserve.kernels import linear_dispatch

if TYPE_CHECKING:
    from step_benchmark import Driver


# Kernel classes summed under the profile's top kernels: which part of the step is short of its floor.
KERNEL_CLASSES = (("GEMM", ("nvjet", "gemm", "cutlass", "cublas", "splitkreduce", "_skinny", "_sum_splits",
                            "aten::mm", "aten::addmm")),
                  ("attention + KV store", ("_split_kernel", "_merge_kernel", "_paged_attention", "_store_kv")),
                  ("norm / rope / SwiGLU", ("_rms_norm", "_rope", "_silu_mul")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, parts in KERNEL_CLASSES if any(p.lower() in low for p in parts)), "other")


def _short(name: str) -> str:
    """An op or kernel name cut to a table cell."""
    return name if len(name) <= 70 else name[:67] + "..."


def profiled_ops(driver: Driver, device: torch.device, k: int, steps: int,
                 chain: int | None = None) -> dict[str, tuple[float, int]]:
    """op / kernel name -> (self microseconds, calls) over `steps` verify steps of k drafts, drafting `chain`
    (device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            driver.verify_step(k, chain)
        common.sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {e.key: (getattr(e, key), e.count) for e in prof.key_averages()
            if getattr(e, key) > 0 and not e.key.startswith("ProfilerStep")}


def draft_profile_table(driver: Driver, device: torch.device, batch: int, args: argparse.Namespace) -> Table:
    """The kernels one draft position adds: step(window 2, chain 1) minus step(window 2, chain 0), per kernel."""
    steps = args.profile_steps
    runs = []
    for chain in (1, 0):
        driver.prefill(batch, 1, args.context, args.prefill_tokens)
        for _ in range(args.warmup):
            driver.verify_step(1, chain)
        runs.append(profiled_ops(driver, device, 1, steps, chain))
    (drafting, plain), zero = runs, (0.0, 0)
    extra = {name: (drafting.get(name, zero)[0] - plain.get(name, zero)[0],
                    drafting.get(name, zero)[1] - plain.get(name, zero)[1]) for name in drafting.keys() | plain.keys()}
    total = sum(us for us, _ in extra.values())
    t = Table(f"one draft position (batch {batch}): kernels of step(window 2, chain 1) beyond step(window 2, "
              f"chain 0), mean of {steps} steps; total {total / steps / 1e3:.3f} ms",
              ["op / kernel", "ms/step", "calls/step"])
    for name, (us, n) in sorted(extra.items(), key=lambda x: -abs(x[1][0]))[: args.top]:
        t.add(_short(name), us / steps / 1e3, f"{n / steps:g}")
    return t


def profile_table(driver: Driver, device: torch.device, k: int, steps: int, top: int) -> Table:
    cuda = device.type == "cuda"
    ops = profiled_ops(driver, device, k, steps)
    events = sorted(ops.items(), key=lambda x: x[1][0], reverse=True)
    total = sum(us for us, _ in ops.values())
    where = "device" if cuda else "CPU"
    t = Table(f"one verify step (batch {len(driver.live)}, k={k}), top ops by self {where} time, "
              f"mean of {steps} steps; total {total / steps / 1e3:.2f} ms",
              ["op / kernel", "ms/step", "%", "calls/step"])
    for name, (us, n) in events[:top]:
        t.add(_short(name), us / steps / 1e3, f"{100 * us / total:.1f}", f"{n / steps:g}")
    for cls in [c for c, _ in KERNEL_CLASSES] + ["other"]:
        mine = [v for name, v in events if kernel_class(name) == cls]
        us = sum(u for u, _ in mine)
        t.add(f"[all {cls}]", us / steps / 1e3, f"{100 * us / total:.1f}", f"{sum(n for _, n in mine) / steps:g}")
    return t


def dispatch_table(bandwidth: float) -> Table:
    """Each GEMM product the linear dispatch measured (in a captured step's conditions, linear_dispatch.measure): the
    route it takes, that route's time and its share of the floor, the weight's bytes at the copy bandwidth (bytes
    a second). Which product holds a step's GEMMs back, shape by shape (issue 12's attribution)."""
    t = Table("GEMM products as the linear dispatch measured them (rows: its bucket of M): the route taken, its time, "
              "and the floor (the weight's bytes at the copy bandwidth) over it",
              ["rows", "N", "K", "route", "us", "floor us", "floor / us", "skinny us", "cuBLAS us", "cuBLASLt us"])
    shapes = []
    for key, choice in linear_dispatch.table().items():
        _, dtype, rows, n, k = key.split("|")
        shapes.append((int(rows[1:]), int(n[1:]), int(k[1:]), getattr(torch, dtype).itemsize, choice))
    for rows, n, k, size, choice in sorted(shapes, key=lambda s: s[:3]):
        route = linear_dispatch.route_taken(choice) if choice.config else "cublas"
        us = {"skinny": choice.skinny_us, linear_dispatch.CUBLASLT: choice.cublaslt_us}.get(route, choice.cublas_us)
        floor_us = n * k * size / bandwidth * 1e6
        t.add(str(rows), str(n), str(k), route, us, floor_us, floor_us / us, choice.skinny_us, choice.cublas_us,
              choice.cublaslt_us)
    return t
