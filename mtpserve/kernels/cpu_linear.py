"""CPU products through oneDNN with each weight packed once, instead of MKL's sgemm, which packs it again
on every call of more than one row.

Why: a verify window of k + 1 rows is what speculation adds to a step, and on the CPU MKL made it
cost 2.5-5x a one-row product even though the weight is read the same once (it copies the weight into
its blocked layout per call). oneDNN's matmul reads a weight reordered once into that layout.
Measured on the 2-core CI machine, fp32, in microseconds, F.linear vs this (benchmarks/RESULTS.md):
the default model's LM head [8192, 256] 307 vs 117 at 1 row, 1473 vs 343 at 4 rows; its gate/up
projection [1536, 256] 42 vs 33 at 1 row, 95 vs 69 at 4 rows (smaller weights stay on F.linear).

  MTPSERVE_CPU_GEMM=onednn (default) fp32 inference products on the CPU take the packed weight
  MTPSERVE_CPU_GEMM=torch            every CPU product is F.linear

The packed copy doubles a CPU model's weight memory; it is made at a weight's first product and kept
as long as the weight lives. Products that autograd records (training) stay on F.linear.
"""

from __future__ import annotations

import os
import weakref

import torch

MODES = ("onednn", "torch")
# Below this many weight elements (1 MiB of fp32) oneDNN's fixed cost per call (10-15 us here) outweighs
# what it saves: MKL's one-row gemv of a [256, 256] weight took 7 us, oneDNN 20.
MIN_PACKED_NUMEL = 1 << 18
_mode = "onednn"
# id(weight) -> ((data_ptr, version), packed); an entry leaves with its weight (weakref.finalize), since a
# WeakKeyDictionary would compare tensors with == on a hash collision.
_packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}


def set_mode(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"MTPSERVE_CPU_GEMM={mode!r}: expected one of {MODES}")
    _mode = mode


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 inference product on the CPU with a weight large enough to gain, oneDNN there and the mode on."""
    return (_mode == "onednn" and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.numel() >= MIN_PACKED_NUMEL
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)) and _AVAILABLE)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] -> [..., N], as F.linear (to float rounding)."""
    return torch.ops.mkldnn._linear_pointwise(x, _packed_weight(weight), bias, "none", [None], "")


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's layout, packed again only after the weight changed in place."""
    stamp = (weight.data_ptr(), _version(weight))
    cached = _packed.get(id(weight))
    if cached is None or cached[0] != stamp:
        if cached is None:
            weakref.finalize(weight, _packed.pop, id(weight), None)
        cached = _packed[id(weight)] = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
    return cached[1]


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # an inference-mode tensor keeps no version (serving never writes weights in place)
        return -1


_AVAILABLE = available()
set_mode(os.environ.get("MTPSERVE_CPU_GEMM", "onednn"))
