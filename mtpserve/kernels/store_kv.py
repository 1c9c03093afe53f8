"""Triton write of this step's K/V rows into the paged cache by slot.

Drop-in for `store_kv_ref`: slot = block * BS + offset within the block; rows with slot < 0 (padding
tokens of a CUDA-graph bucket, tokens whose KV this group does not keep) are skipped. Values are cast
to the cache dtype on the way in.

One program per (token, group of KV heads): a token's rows are a few KB, so the launch is a single
wave of small, independent copies. key/value may be strided views (e.g. slices of a fused QKV
projection output) as long as head_dim is contiguous, so the caller need not copy them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # int64 throughout: a large pool has more than 2**31 elements.
    page = slot // PAGE
    offset = slot % PAGE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + page * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + page * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# TRITON_INTERPRET=1 at import time makes @triton.jit return an interpreted function instead.
_INTERPRETED = not isinstance(_store_kv_kernel, triton.runtime.jit.JITFunction)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], written in place
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64 (int32 works too), < 0 = skip
) -> None:
    """Write key[t] / value[t] into cache slot slot_mapping[t] for every t with a non-negative slot.

    Slots are not bounds-checked (that would need a device sync); a slot >= NB * BS writes out of
    bounds. Duplicate slots leave one of the rows, unspecified which, as the reference does.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    _, page, cache_heads, cache_dim = k_cache.shape
    if value.shape != key.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} or the caches disagree")
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"rows of shape {(num_kv_heads, head_dim)} do not fit a cache of {tuple(k_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} does not match {num_tokens} tokens")
    if any(t.stride(-1) != 1 for t in (key, value, k_cache, v_cache)):
        raise ValueError("key, value and the caches need a unit stride along head_dim")
    if num_tokens == 0:
        return
    if _INTERPRETED and (key.dtype != k_cache.dtype or value.dtype != v_cache.dtype):
        # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: cast with torch.
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)

    block_d = triton.next_power_of_2(head_dim)
    # About 4K elements per program: enough to keep a token's copy in one program for typical shapes.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )
