"""Triton rotate-half (NeoX) RoPE: one kernel per tensor instead of a dozen elementwise ones.

Semantics of `rope_ref` (rope_ref.py): the first `rot` dims of every head turn by the position's
angle in fp32 and round to the input dtype; the rest (partial rotary, GLM-4.5) pass through. x may be
a strided view (q or k sliced out of a fused QKV projection, unit stride along D); the output is a
fresh contiguous [T, heads, D]. One program per (token, block of heads): the cos/sin row of a token is
read once for all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    out_ptr, x_ptr, cos_ptr, sin_ptr, pos_ptr, num_heads,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
    HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF_P)  # [HALF_P]
    ok = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    c = tl.load(cos_ptr + pos * stride_c + offs, mask=offs < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_c + offs, mask=offs < HALF, other=0.0)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(src + offs[None, :], mask=ok, other=0.0)
    x2 = tl.load(src + HALF + offs[None, :], mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + offs[None, :], (a * c - b * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + offs[None, :], (b * c + a * s).to(out_ptr.dtype.element_ty), mask=ok)
    if REST > 0:  # partial rotary: the dims past 2 * HALF are copied
        rest = tl.arange(0, REST_P)
        keep = (heads < num_heads)[:, None] & (rest < REST)[None, :]
        tail = tl.load(src + 2 * HALF + rest[None, :], mask=keep, other=0.0)
        tl.store(dst + 2 * HALF + rest[None, :], tail, mask=keep)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Drop-in for rope_ref: x [T, heads, D] (unit stride along D), cos/sin [P, rot // 2] fp32, positions [T]."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, heads, D] with a unit stride along D, got {tuple(x.shape)}")
    half = cos.shape[-1]
    if sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride() or 2 * half > x.shape[-1]:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit heads of {x.shape[-1]}")
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel():
        rest = head_dim - 2 * half
        block_h = min(triton.next_power_of_2(num_heads), 16)
        _rope_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out, x, cos, sin, positions, num_heads,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=half, HALF_P=triton.next_power_of_2(half), REST=rest, REST_P=max(1, triton.next_power_of_2(rest)),
            BLOCK_H=block_h, num_warps=4,
        )
    return out
