"""Plain-torch block-scaled FP8 linear: the CPU path and the Triton kernel's oracle.

Shapes (N rows, K input features, M output features, blocks of (BM, BK) weight elements):
  x          [N, K]                    activations (fp32 / bf16 / fp16)
  weight     [M, K] float8_e4m3fn      DeepSeek-V3 layout: weight = fp8 * scale_inv per block
  scale_inv  [ceil(M/BM), ceil(K/BK)]  fp32
  ->         [N, M]                    x @ dequantised(weight)^T in x's dtype
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [M, K] and per-block scales -> fp32 [M, K] (each element one fp32 product: exact)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows]
    scale = scale.repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return F.linear(x, dequantize_block_fp8(weight, scale_inv, block).to(x.dtype))
