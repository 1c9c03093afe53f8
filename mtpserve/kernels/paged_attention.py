"""Triton attention over a paged KV cache for a flat varlen batch (prefill chunks and verify windows).

Drop-in for `paged_attention_ref` (same arguments, same semantics, see that module for the shapes).
Query i of request r sits at absolute position seq_lens[r] - qlen[r] + i and attends to positions <= it.

Design (FlashAttention-2 style, one pass, no split-KV):
  * one program per (query block, KV head); a query block is BLOCK_Q consecutive queries of one request,
    and the GQA group's query heads are packed into the M dimension (row m = query m // GROUP_P, head
    m % GROUP_P), so each K/V tile read from HBM serves every query head that shares it;
  * query blocks are numbered over the flat batch (request r owns ids qsl[r] // BLOCK_Q + r onwards), so
    the grid depends only on the token and request counts and the tile shape: no host sync, no padding
    of every request to max_query_len, and a CUDA-graph bucket keeps one grid. A program finds its
    request by binary search over query_start_loc;
  * K/V tiles of BLOCK_N positions are gathered through the block table position by position, so
    BLOCK_N is independent of the page size (any page size works);
  * online softmax in base 2 with fp32 statistics and accumulator; tiles every row of the block sees in
    full run without masks, only the tiles on the causal diagonal pay for them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.pdl import wait_previous

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    # Request r owns query-block ids starting at qsl[r] // BLOCK_Q + r (the "+ r" absorbs each request's
    # partial last block); find the last r whose start is <= pid.
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, start, kv_end, k_ptr, v_ptr, bt_row_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    offs_n = start + tl.arange(0, BLOCK_N)  # absolute positions of this tile
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_ok = offs_n < kv_end
        page = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE).to(tl.int64)
    # int64: a large pool has more than 2**31 elements.
    k_off = page * stride_kb + (offs_n % PAGE) * stride_ks + kv_head * stride_kh
    v_off = page * stride_vb + (offs_n % PAGE) * stride_vs + kv_head * stride_vh
    if MASKED:
        k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)  # [D, N]
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)  # [N, D]
    else:
        k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None])
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])

    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
    if MASKED:
        # Positions >= kv_end lie beyond every valid row's own position, so the causal test covers them.
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    # m_i starts finite, so a row that sees nothing in this tile keeps alpha = 1 and p = 0 (no NaN).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the tensor-core operand's precision, also when UPCAST (so tests see the GPU's error)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _load_queries(q_ptr, q_begin, qi, head, row_ok, stride_qt, stride_qh,
                  HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Rows m of the M tile: query qi[m] of the request (flat row q_begin + qi[m]), head head[m]."""
    offs_d = tl.arange(0, HEAD_DIM)
    row_off = (q_begin + qi).to(tl.int64)
    q = tl.load(q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    return q, row_off


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, q_pos, lo, full_end, hi, kv_end, k_ptr, v_ptr, bt_row_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Tiles from lo to hi: those below full_end (every row sees them whole) without masks, the rest masked."""
    for start in range(lo, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start, kv_end, k_ptr, v_ptr, bt_row_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            BLOCK_N, HEAD_DIM, PAGE, False, DOT_PRECISION, UPCAST)
    for start in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start, kv_end, k_ptr, v_ptr, bt_row_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            BLOCK_N, HEAD_DIM, PAGE, True, DOT_PRECISION, UPCAST)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_reqs"])  # a new batch size must not recompile
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    num_reqs, qk_scale,
    stride_ot, stride_oh, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_Q + req)) * BLOCK_Q  # first query of this block, within the request
    if q_start >= qlen:
        return  # spare id: the grid is an upper bound on the number of query blocks
    ctx = tl.load(seq_lens_ptr + req) - qlen  # positions cached before this step's first query

    offs_m = tl.arange(0, BLOCK_M)
    qi = q_start + offs_m // GROUP_P  # query index within the request
    head = kv_head * GROUP + offs_m % GROUP_P
    row_ok = (qi < qlen) & (offs_m % GROUP_P < GROUP)
    q_pos = ctx + qi
    q, row_off = _load_queries(q_ptr, q_begin, qi, head, row_ok, stride_qt, stride_qh, HEAD_DIM, UPCAST)
    offs_d = tl.arange(0, HEAD_DIM)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_bt
    # Every row sees positions <= its own, the smallest being the block's first query: tiles wholly below
    # it need no mask. The last valid query's position bounds the diagonal tiles.
    full_end = (ctx + q_start + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx + tl.minimum(q_start + BLOCK_Q, qlen)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, 0, full_end, kv_end, kv_end, k_ptr, v_ptr, bt_row_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
        BLOCK_N, HEAD_DIM, PAGE, DOT_PRECISION, UPCAST)

    out = acc / l_i[:, None]  # valid rows always see position 0, so l_i > 0 where it is stored
    tl.store(out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# TRITON_INTERPRET=1 at import time makes @triton.jit return an interpreted function instead.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.jit.JITFunction)


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The layout both paged-attention kernels need; raises ValueError naming what does not fit."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_k = k_cache.shape[2], k_cache.shape[3]
    if v_cache.shape != k_cache.shape or head_dim_k != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q {q.dtype} and the caches {k_cache.dtype} / {v_cache.dtype} must share a dtype")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a unit stride along head_dim")


# Programs (request, KV head) of 64-position tiles at head_dim 128 that one SM holds at once: each keeps
# two stages of K and V tiles, 64 KB of its 228 KB of shared memory.
_PROGRAMS_PER_SM_AT_64 = 3


def one_pass_block_n(num_reqs: int, num_kv_heads: int, head_dim: int, sm_count: int, window: int = 1,
                     shared_memory: int = 227 * 1024) -> int:
    """The one-pass kernel's KV tile: 64 positions (32 past head_dim 128), or 32 where the programs would not
    all fit one wave of 64-position tiles. Then a second, mostly empty wave held the 8B decode step's
    attention at batch 64 (512 programs on 132 SMs) to 80 % of its bytes' floor, and 32-position tiles,
    all resident at once, reached 93 % (91 % for 4-token windows; H100, run 88). Where the programs fit,
    the larger tile is the faster one (at batch 32, 8192 positions: 96 % against 80 %), and a verify
    window's (2..16 queries) programs that fill at most two waves take 128-position tiles: at batch 32
    they beat 64 by 2-3 % at 1024 and 8192 positions (H100, session L). shared_memory: a block's opt-in
    bytes; two stages of 128-position K and V tiles need 128 KB."""
    if head_dim > 128:
        return 32
    programs = num_reqs * num_kv_heads
    wide = 2 * 2 * 128 * head_dim * 2  # stages x (K, V) x positions x head_dim x 2 bytes: 128 KB
    # (+ 32 KB: the query tile and the compiler's own buffers)
    if 1 < window <= 16 and programs <= 2 * sm_count and head_dim == 128 and shared_memory >= wide + (32 << 10):
        return 128
    fits = _PROGRAMS_PER_SM_AT_64 * (128 // max(head_dim, 16)) * sm_count
    return 32 if programs > fits else 64


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 off CUDA: an H100's, for interpreted runs)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def shared_memory(device: torch.device) -> int:
    """Shared memory a block may opt in to (227 KB off CUDA: an H100's, for interpreted runs)."""
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 227 * 1024


@functools.lru_cache(maxsize=None)
def _shared_memory(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32, this step's tokens included
    block_tables: torch.Tensor,  # [R, MB] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_stages: int = 2,
    num_warps: int | None = None,
) -> torch.Tensor:  # [T, H, D], q's dtype
    """Causal attention of every query in the flat batch over its request's paged context.

    max_query_len only picks the tile shape (verify-only batches get small M tiles); max_seq_len is
    unused because the kernel reads seq_lens on the device. block_m / block_n override the tiles
    (powers of two >= 16), num_stages the K/V tiles in flight and num_warps the warps per program, for tuning
    and tests. Nothing here
    syncs with the device.
    """
    check_paged_inputs(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    cap = 128 if head_dim <= 128 else 64
    if block_m is None:
        block_m = min(cap, max(16, triton.next_power_of_2(max(1, max_query_len) * group_p)))
    block_m = max(block_m, group_p)  # at least one query per block
    block_q = block_m // group_p
    if block_n is None:
        block_n = one_pass_block_n(num_reqs, num_kv_heads, head_dim, sm_count(q.device), max_query_len,
                                   shared_memory(q.device))
    for name, tile in (("block_m", block_m), ("block_n", block_n)):
        if tile < 16 or tile & (tile - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {tile}")
    num_warps = num_warps or (8 if block_m >= 128 else 4)
    # fp32 inputs are the exact path (tests, debugging): keep the dots out of TF32.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # The interpreter's tl.dot multiplies bf16 tiles' raw uint16 storage: widen the operands to fp32
    # there. bf16/fp16 products are exact in fp32, so this matches the tensor cores up to summation order.
    upcast = _INTERPRETED and q.dtype != torch.float32
    if upcast:
        precision = "ieee"

    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        num_reqs, scale * _LOG2E,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, PAGE=page, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages, **pdl.options(q.device),
    )
    return out
