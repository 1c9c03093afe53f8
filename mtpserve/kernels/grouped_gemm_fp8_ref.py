"""Plain-torch grouped GEMM over block-scaled FP8 experts: the CPU path and the Triton kernel's oracle.

Shapes (N rows routed to experts, E experts, K input features, M output features, blocks (BM, BK)):
  x          [N, K]                       rows sorted by expert, as in grouped_gemm_ref
  weight     [E, M, K] float8_e4m3fn      expert e's matrix = fp8 * scale_inv[e] per block
  scale_inv  [E, ceil(M/BM), ceil(K/BK)]  fp32
  offsets    [E + 1]                      int64, expert e owns rows offsets[e] .. offsets[e+1]-1
  ->         [N, M]                       grouped_gemm_ref over the dequantised experts (in x's dtype)

It dequantises every expert on each call: a test oracle and the path of an FP8-served model on a
CPU (tests only; CPU serving dequantises once at load instead).
"""

from __future__ import annotations

import torch

from mtpserve.kernels.grouped_gemm_ref import grouped_gemm_ref


def dequantize_experts_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [E, M, K] and per-expert block scales -> fp32 [E, M, K] (each element one fp32 product: exact)."""
    _, rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=1)[:, :rows]
    scale = scale.repeat_interleave(block[1], dim=2)[:, :, :cols]
    return weight.float() * scale


def grouped_gemm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, offsets: torch.Tensor,
                         block: tuple[int, int]) -> torch.Tensor:
    return grouped_gemm_ref(x, dequantize_experts_fp8(weight, scale_inv, block).to(x.dtype), offsets)
