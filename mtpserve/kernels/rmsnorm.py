"""Triton RMSNorm, optionally fused with the residual add before it: one kernel instead of six.

Semantics of `rms_norm_ref` (rmsnorm_ref.py, the Llama/Qwen reference): normalise in fp32, round to the input dtype,
then multiply by the weight in that dtype. With `residual`, the sum x + residual (rounded to x's
dtype, as the unfused add would) is normalised and returned too, so a decoder layer's
`h = h + attn(...)` followed by the next norm reads and writes the hidden rows once.

Rows may be strided views (q or k heads sliced out of a fused projection): x is [T, R, D] with any
strides on the first two dims and a unit stride on D; a 2-D x is one row per token. One program per
row: a row of a few thousand values fits one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.pdl import wait_previous


@triton.jit
def _rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, res_ptr, w_ptr, eps, rows_per_token,
    stride_xt, stride_xr, stride_rt, stride_rr, stride_ot, stride_or, stride_st, stride_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    row = tl.program_id(0)
    token = (row // rows_per_token).to(tl.int64)
    r = (row % rows_per_token).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + token * stride_xt + r * stride_xr + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + token * stride_rt + r * stride_rr + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # the unfused add's rounding
        tl.store(sum_ptr + token * stride_st + r * stride_sr + offs, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)  # [D]: rounded to the input dtype first
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + r * stride_or + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for rms_norm_ref on 2-D [T, D] or 3-D [T, R, D] rows with a unit stride along D."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] or [T, R, D] with a unit stride along D, got {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {x.shape[-1]}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)} with a unit stride")
    rows3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, R, D]
    res3 = rows3 if residual is None else (residual if residual.dim() == 3 else residual.unsqueeze(1))
    num_tokens, rows_per_token, d = rows3.shape
    out = torch.empty(rows3.shape, dtype=x.dtype if weight.dtype == x.dtype else torch.promote_types(
        x.dtype, weight.dtype), device=x.device)
    summed = torch.empty(rows3.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if out.numel():
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(num_tokens * rows_per_token,)](
            out, summed, rows3, res3, weight, eps, rows_per_token,
            rows3.stride(0), rows3.stride(1), res3.stride(0), res3.stride(1),
            out.stride(0), out.stride(1), summed.stride(0), summed.stride(1),
            D=d, BLOCK_D=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)), **pdl.options(x.device),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, summed.view(x.shape))
