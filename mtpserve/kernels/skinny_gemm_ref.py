"""Plain-torch skinny GEMM: the CPU path and the Triton kernel's oracle.

Shapes (M rows, K input features, N output features; nn.Linear layout):
  x       [M, K]   activations (fp32 / bf16 / fp16), M small (a decode or verify batch: 1..256 rows)
  weight  [N, K]   same dtype as x
  bias    [N] or None
  ->      [M, N]   x @ weight^T (+ bias), accumulated in fp32 and rounded once to x's dtype
"""

from __future__ import annotations

import torch


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 product of the operands as stored, bias added in fp32, one rounding: what the kernel computes."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
