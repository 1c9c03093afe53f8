"""Triton q/k RMSNorm + RoPE + paged KV store in one launch (drop-in for `qk_norm_rope_store_ref`).

Unfused, a layer spends five launches here (q norm, k norm, two RoPEs, the store), each a couple of
microseconds of a small model's decode step and a node of its CUDA graph. One program per (token,
head): q heads write the rotated q; k heads write their rotated row and the token's v row into the
cache slot. Each stage rounds to the input dtype where the unfused kernels do (the normed row before
the weight, the weighted row before RoPE), so only the order of the norm's sum differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.pdl import wait_previous


@triton.jit
def _normed_rotated(src, w_ptr, cos_row, sin_row, eps,
                    D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr,
                    REST_P: tl.constexpr, NORM: tl.constexpr):
    """One head's row at src -> (rotated first half [HALF_P], second half, pass-through tail [REST_P])."""
    offs = tl.arange(0, HALF_P)
    in_half = offs < HALF
    rest = tl.arange(0, REST_P)
    in_rest = rest < REST
    x1 = tl.load(src + offs, mask=in_half, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=in_half, other=0.0)
    x3 = tl.load(src + 2 * HALF + rest, mask=in_rest, other=0.0)
    dtype = x1.dtype
    if NORM:
        f1, f2, f3 = x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0) + tl.sum(f3 * f3, 0)) / D + eps)
        w1 = tl.load(w_ptr + offs, mask=in_half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=in_half, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + 2 * HALF + rest, mask=in_rest, other=0.0).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (f2 * inv).to(dtype).to(tl.float32)).to(dtype)
        x3 = (w3 * (f3 * inv).to(dtype).to(tl.float32)).to(dtype)
    c = tl.load(cos_row + offs, mask=in_half, other=0.0)
    s = tl.load(sin_row + offs, mask=in_half, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * c - b * s).to(dtype), (b * c + a * s).to(dtype), x3


@triton.jit
def _qk_norm_rope_store_kernel(
    q_out_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_c,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr,
    REST_P: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * stride_c, sin_ptr + pos * stride_c
    offs, rest = tl.arange(0, HALF_P), tl.arange(0, REST_P)
    in_half, in_rest = offs < HALF, rest < REST
    if head < NUM_HEADS:  # a query head: rotated into q_out
        o1, o2, o3 = _normed_rotated(q_ptr + token * stride_qt + head * stride_qh, qw_ptr, cos_row, sin_row, eps,
                                     D, HALF, HALF_P, REST, REST_P, NORM)
        dst = q_out_ptr + token * stride_ot + head * stride_oh
        tl.store(dst + offs, o1, mask=in_half)
        tl.store(dst + HALF + offs, o2, mask=in_half)
        tl.store(dst + 2 * HALF + rest, o3, mask=in_rest)
    else:  # a KV head: rotated k and the token's v into the cache slot
        kv_head = (head - NUM_HEADS).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            o1, o2, o3 = _normed_rotated(k_ptr + token * stride_kt + kv_head * stride_kh, kw_ptr, cos_row, sin_row,
                                         eps, D, HALF, HALF_P, REST, REST_P, NORM)
            page, offset = slot // PAGE, slot % PAGE
            k_dst = k_cache_ptr + page * stride_kcb + offset * stride_kcs + kv_head * stride_kch
            kty = k_cache_ptr.dtype.element_ty
            tl.store(k_dst + offs, o1.to(kty), mask=in_half)
            tl.store(k_dst + HALF + offs, o2.to(kty), mask=in_half)
            tl.store(k_dst + 2 * HALF + rest, o3.to(kty), mask=in_rest)
            full = tl.arange(0, 2 * HALF_P)
            v_src = v_ptr + token * stride_vt + kv_head * stride_vh
            v_dst = v_cache_ptr + page * stride_vcb + offset * stride_vcs + kv_head * stride_vch
            vty = v_cache_ptr.dtype.element_ty
            tl.store(v_dst + full, tl.load(v_src + full, mask=full < 2 * HALF).to(vty), mask=full < 2 * HALF)
            tl.store(v_dst + 2 * HALF + rest, tl.load(v_src + 2 * HALF + rest, mask=in_rest).to(vty), mask=in_rest)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (unit stride along D), weights [D] in q's dtype or both None, cos/sin
    [P, rot // 2] fp32, positions/slot_mapping [T], caches [NB, BS, Hkv, D] -> rotated q [T, H, D].
    Slots are not bounds-checked (that would need a device sync)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos.shape[-1]
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold {num_kv_heads} "
                         f"heads of {head_dim}")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)) or 2 * half > head_dim or sin.shape != cos.shape:
        raise ValueError("q, k, v and the caches need a unit stride along D, and cos/sin at most D / 2 columns")
    if (q_weight is None) != (k_weight is None) or (q_weight is not None and (
            q_weight.shape != (head_dim,) or q_weight.dtype != q.dtype or k_weight.dtype != q.dtype)):
        raise ValueError("q_weight and k_weight must both be None or both [D] in q's dtype")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} / slot_mapping {tuple(slot_mapping.shape)} "
                         f"must be [{num_tokens}]")
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    norm = q_weight is not None
    rest = head_dim - 2 * half
    _qk_norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        q_out, q, k, v, q_weight if norm else q, k_weight if norm else q, cos, sin, positions, slot_mapping,
        k_cache, v_cache, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, D=head_dim, HALF=half, HALF_P=triton.next_power_of_2(half), REST=rest,
        REST_P=max(1, triton.next_power_of_2(rest)), PAGE=k_cache.shape[1], NORM=norm, num_warps=1,
        **pdl.options(q.device),
    )
    return q_out
