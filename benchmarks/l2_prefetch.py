#!/usr/bin/env python
"""What an L2 prefetch of a GEMM's weight (kernels/l2_prefetch.py) buys when it is issued ahead of a spell in which
HBM idles, as the attention leaves it before the o projection.

    python benchmarks/l2_prefetch.py [--rows 1,8,32,128] [--idle-us 0,3,6,10] [--n 4096 --k 4096]

Per call of a CUDA graph: [prefetch of this call's weight] -> a spin kernel of --idle-us (no memory traffic) ->
the product x @ w^T through the linear dispatch (its measured route). The weight cycles through copies that
take twice the L2, so no call finds its weight there but by the prefetch. Per (rows, idle): microseconds per
call without a prefetch, with one and with one that marks its lines evict-last, each less the idle spell: the
product's own time, against its weight's bytes at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.kernels import linear_dispatch  # noqa: E402
from mtpserve.kernels.l2_prefetch import l2_prefetch  # noqa: E402

VARIANTS = {"none": "0", "prefetch": "1", "evict-last": "last"}


def spin_cycles(us: float, device: torch.device) -> int:
    """torch.cuda._sleep's cycles for about `us` microseconds (its clock: the SM clock)."""
    mhz = torch.cuda.get_device_properties(device).clock_rate / 1e3  # kHz -> MHz
    return int(us * mhz)


def per_call_us(rows: int, idle_us: float, variant: str, weights: list[torch.Tensor], x: torch.Tensor,
                reps: int) -> float:
    """Microseconds per (prefetch, spin, product) call, less the spin's own time."""
    os.environ["MTPSERVE_L2_PREFETCH"] = VARIANTS[variant]
    cycles = spin_cycles(idle_us, x.device)

    def call(w: torch.Tensor) -> torch.Tensor:
        l2_prefetch(w)
        if cycles:
            torch.cuda._sleep(cycles)
        return linear_dispatch.linear(x[:rows], w)

    with_product = linear_dispatch.replay_us(call, weights, reps)
    os.environ["MTPSERVE_L2_PREFETCH"] = "0"
    spin_only = linear_dispatch.replay_us(lambda w: torch.cuda._sleep(cycles) if cycles else None, weights, reps) \
        if cycles else 0.0
    return with_product - spin_only


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--idle-us", default="0,3,6,10")
    p.add_argument("--n", type=int, default=4096, help="output features (the 8B o projection: 4096)")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    device = common.pick_device(args.device)
    common.check(device.type == "cuda", "needs a CUDA GPU")
    bandwidth = common.measure_bandwidth(device, 2 << 30)
    weight = torch.randn(args.n, args.k, device=device, dtype=torch.bfloat16) / args.k**0.5
    weights = linear_dispatch.weight_copies(weight)
    x = torch.randn(max(common.parse_ints(args.rows)), args.k, device=device, dtype=torch.bfloat16)
    floor_us = weight.numel() * weight.element_size() / bandwidth * 1e6
    t = Table(f"product {args.n} x {args.k} after an idle spell: us per call less the spell (floor {floor_us:.2f} us)",
              ["rows", "idle us", *VARIANTS, "prefetch / none", "evict-last / none"])
    for rows in common.parse_ints(args.rows):
        for idle in (float(v) for v in args.idle_us.split(",")):
            us = {v: per_call_us(rows, idle, v, weights, x, args.reps) for v in VARIANTS}
            t.add(str(rows), f"{idle:g}", *(f"{us[v]:.2f}" for v in VARIANTS), f"{us['prefetch'] / us['none']:.3f}",
                  f"{us['evict-last'] / us['none']:.3f}")
    common.report(args, "l2_prefetch", device, [t], [f"copy bandwidth {bandwidth / 1e12:.3f} TB/s",
                                                     f"weight copies cycled: {len(weights)}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
