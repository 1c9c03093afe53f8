"""Split-KV (flash-decoding) paged attention for decode steps and verify windows.

With few requests, one program per (request, KV head) leaves most SMs idle while each program
streams a long context alone: at batch 1 an 8-KV-head model runs 8 programs per layer. Here each
request's context is cut into `num_splits` ranges of whole tiles; a program attends its request's
whole query window (every query head of one KV head packed into the M dimension, as in
paged_attention.py) over one range and writes an unnormalised partial result with its running max
and sum (fp32, log2 units); a second kernel merges the splits of every (token, head).

Drop-in for `paged_attention` (same arguments and semantics) for batches whose requests each bring at
most MAX_WINDOW queries. The split count is chosen on the host from the batch shape and the context
bound `max_seq_len` (`num_splits_for`); the range a split covers is derived on the device from the
request's actual length, so the grid stays fixed for a CUDA-graph bucket and nothing syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.paged_attention import _LOG2E, _attend_range, _load_queries, check_paged_inputs, sm_count
from mtpserve.kernels.pdl import wait_previous

MAX_WINDOW = 16  # queries per request (1 + drafts) this kernel takes; longer ones go to paged_attention
_MIN_TILES_PER_SPLIT = 2  # a split shorter than this costs more in merging than it gains
_PROGRAMS_PER_SM = 2


@triton.jit
def _split_kernel(
    acc_ptr, m_ptr, l_ptr, q_ptr, k_ptr, v_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale,
    stride_at, stride_as, stride_ah, stride_mt, stride_ms, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_begin = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - q_begin
    kv_end = tl.load(seq_lens_ptr + req)
    ctx = kv_end - qlen  # positions cached before this step's first query

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP_P  # query index within the request
    head = kv_head * GROUP + offs_m % GROUP_P
    row_ok = (qi < qlen) & (offs_m % GROUP_P < GROUP)
    q_pos = ctx + qi
    q, row_off = _load_queries(q_ptr, q_begin, qi, head, row_ok, stride_qt, stride_qh, HEAD_DIM, UPCAST)
    offs_d = tl.arange(0, HEAD_DIM)

    # This split's tiles: an equal share of the request's own tiles (empty past its length).
    tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS)
    lo = tl.minimum(split * per_split, tiles) * BLOCK_N
    hi = tl.minimum(split * per_split + per_split, tiles) * BLOCK_N
    # Tiles wholly below the first query's position need no causal mask (see paged_attention.py).
    full_end = tl.minimum(tl.maximum((ctx + 1) // BLOCK_N * BLOCK_N, lo), hi)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, lo, full_end, hi, kv_end, k_ptr, v_ptr, bt_row_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
        BLOCK_N, HEAD_DIM, PAGE, DOT_PRECISION, UPCAST)

    # Partials of an empty split keep m = -1e30 and l = 0: the merge gives them no weight.
    part = split.to(tl.int64)
    tl.store(acc_ptr + row_off[:, None] * stride_at + part * stride_as + head[:, None] * stride_ah + offs_d[None, :],
             acc, mask=row_ok[:, None])
    ml_off = row_off * stride_mt + part * stride_ms + head
    tl.store(m_ptr + ml_off, m_i, mask=row_ok)
    tl.store(l_ptr + ml_off, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(
    out_ptr, acc_ptr, m_ptr, l_ptr,
    stride_ot, stride_oh, stride_at, stride_as, stride_ah, stride_mt, stride_ms,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    s_ok = offs_s < NUM_SPLITS
    ml_off = token * stride_mt + offs_s * stride_ms + head
    m = tl.load(m_ptr + ml_off, mask=s_ok, other=-1.0e30)  # [S]
    l_s = tl.load(l_ptr + ml_off, mask=s_ok, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # [S], 1 for the split holding the max
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + token * stride_at + offs_s[:, None] * stride_as + head * stride_ah + offs_d[None, :],
                  mask=s_ok[:, None], other=0.0)  # [S, D]
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)  # every query sees position 0: > 0
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# TRITON_INTERPRET=1 at import time makes @triton.jit return an interpreted function instead.
_INTERPRETED = not isinstance(_split_kernel, triton.runtime.jit.JITFunction)


def num_splits_for(num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, group: int,
                   sm_count: int, block_n: int = 64) -> int:
    """How many KV splits fill the GPU: 1 means the one-pass kernel is the better choice.

    Splits only pay while (requests x KV heads) programs leave SMs idle, and only for windows that fit
    one M tile; each split keeps at least _MIN_TILES_PER_SPLIT tiles of the longest possible context.
    A verify window whose programs fill every SM once is not split: the partials grow with the window
    (4 tokens x 32 heads x 128 fp32 per split and request), and at batch 32 the one-pass kernel's
    128-position tiles ran at 81 % of the KV bytes where split 2 ran at 78 % (H100, session L).
    """
    if max_query_len > MAX_WINDOW or max_query_len * triton.next_power_of_2(group) > 128:
        return 1
    if max_query_len > 1 and num_reqs * num_kv_heads >= sm_count:
        return 1
    wanted = -(-_PROGRAMS_PER_SM * sm_count // max(1, num_reqs * num_kv_heads))
    longest = -(-max_seq_len // (block_n * _MIN_TILES_PER_SPLIT))
    return max(1, min(wanted, longest))


def paged_attention_split(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32, this step's tokens included
    block_tables: torch.Tensor,  # [R, MB] int32
    max_query_len: int,  # a host-side bound on every request's query count, <= MAX_WINDOW
    max_seq_len: int,  # a host-side bound on every seq_len (sizes the split count only)
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_stages: int = 2,  # K/V tiles in flight per program
    num_warps: int | None = None,  # per program of the split kernel (None: by the M tile)
) -> torch.Tensor:  # [T, H, D], q's dtype
    """Causal attention of every query over its request's paged context, the context split across programs."""
    check_paged_inputs(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    if max_query_len > MAX_WINDOW:
        raise ValueError(f"max_query_len {max_query_len} exceeds the split kernel's window of {MAX_WINDOW}")
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_m = max(16, triton.next_power_of_2(max(1, max_query_len) * group_p))
    block_n = block_n or (64 if head_dim <= 128 else 32)
    if num_splits is None:
        num_splits = num_splits_for(num_reqs, num_kv_heads, max_query_len, max_seq_len, group, sm_count(q.device),
                                    block_n)
    # Partials per (token, split, head): fp32 accumulators and softmax statistics.
    acc = torch.empty((num_tokens, num_splits, num_heads, head_dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((2, num_tokens, num_splits, num_heads), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = _INTERPRETED and q.dtype != torch.float32  # see paged_attention.py
    if upcast:
        precision = "ieee"
    _split_kernel[(num_reqs, num_kv_heads, num_splits)](
        acc, stats[0], stats[1], q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale * _LOG2E,
        acc.stride(0), acc.stride(1), acc.stride(2), stats.stride(1), stats.stride(2), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, PAGE=page,
        NUM_SPLITS=num_splits, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps or (4 if block_m <= 64 else 8), num_stages=num_stages, **pdl.options(q.device),
    )
    _merge_kernel[(num_tokens, num_heads)](
        out, acc, stats[0], stats[1],
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), stats.stride(1), stats.stride(2),
        NUM_SPLITS=num_splits, SPLITS_P=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim,
        num_warps=2 if head_dim <= 64 else 4, **pdl.options(q.device),
    )
    return out
