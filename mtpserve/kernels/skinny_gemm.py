"""Triton GEMM for few rows: y [M, N] = x [M, K] @ w [N, K]^T (+ bias), built to stream w at HBM speed.

Drop-in for `skinny_gemm_ref` (and F.linear) when M is a decode or verify batch (1..256 rows). Such a
product reads every weight once and does little arithmetic per byte, so the kernel is shaped around
the weight stream, not around the MMA:
  * swap-AB: a program owns a BLOCK_N strip of w as the MMA's wide side and all (up to BLOCK_M) rows
    of x as the narrow side, acc [BLOCK_N, BLOCK_M] = sum_k w[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, BLOCK_M].
    tl.dot needs 16 on every side, so M pads to 16 / 32 / 64 (masked loads: no copy of x).
  * M above BLOCK_M: the m-tile is the fastest grid axis, so the tiles that read one w strip run side
    by side and all but the first read it from L2.
  * split-K when N / BLOCK_N strips cannot fill the SMs (a 4096-wide output is 64 strips of 64 on
    132 SMs): SPLIT programs per strip each take a contiguous K range and write fp32 partials
    [SPLIT, M, N]; a second small kernel sums them, adds the bias and rounds (atomic-free, so the
    result does not depend on the order programs finish, and graph replays are deterministic). A config
    may instead fuse that sum (SkinnyConfig.fused): the last program of a tile to finish (an arrival
    counter per output tile) sums its partials in the same split order, so the result is the same bits
    and a step has one kernel less per such product. Which one a shape runs is measured like the rest.
Nothing is read on the host and nothing depends on tensor values, so a call is CUDA-graph capturable;
M is not specialised (one compile per tile shape, whatever the batch), and which config serves which
(M bucket, N, K) is measured by mtpserve/kernels/linear_dispatch.py, outside any capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.pdl import wait_previous

MAX_ROWS = 256  # beyond this, a step is not weight-streaming any more: F.linear (cuBLAS) takes it
# MTPSERVE_SKINNY_FUSED=off leaves the fused split sums out of the candidates (A/B runs; set MTPSERVE_SKINNY_CACHE
# empty too, since a cache keeps what was measured before).
FUSED_SPLIT_SUM = os.environ.get("MTPSERVE_SKINNY_FUSED", "on") != "off"


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # weight rows (output features) per program
    block_k: int  # K per loop iteration
    split: int  # programs per strip along K (1: no partials, no second kernel)
    num_warps: int
    num_stages: int
    # With a split: the last program of each output tile to finish its K range sums the tile's partials (an arrival
    # counter per tile) instead of a second kernel. False: _sum_splits_kernel does (see _counters_of).
    fused: bool = False

    def as_list(self) -> list[int]:
        return [self.block_n, self.block_k, self.split, self.num_warps, self.num_stages, int(self.fused)]


# The tile shapes tried per (M bucket, N, K): few on purpose, each one is a compile per M tile (and per
# split or not). (block_n, block_k, num_warps, num_stages); all stages of w and x tiles take at most
# 192 KB of shared memory at BLOCK_M 64 (an H100 block may have 227 KB), 100 KB or less at BLOCK_M 16.
# Five stages of 64 x 128: at 64-128 rows, the down projection reached 85 % of its bytes where four
# stages reached 78 % and cuBLAS 75 % (H100, a sweep of 72 tiles in session L); tiles of 128 rows, 256
# weight rows or other stage counts won nowhere in that sweep.
TILES = ((64, 128, 4, 4), (64, 128, 4, 5), (128, 128, 4, 3), (32, 256, 4, 4), (64, 256, 8, 3))


def block_m(m: int) -> int:
    """Rows per tile: M padded to 16 / 32 / 64 (tl.dot's minimum is 16); more rows take more tiles. One 128-row
    tile (each weight strip read once) made gate/up at 128 rows 72 us against 97 for two 64-row tiles, but no
    shape beat cuBLAS (H200, run 259: gate/up 71, q/k/v 19 against 24, o and down 0.8 and 1.2 us slower than cuBLAS)."""
    return min(64, max(16, triton.next_power_of_2(m)))


def m_bucket(m: int) -> int:
    """The M class a measured choice holds for: 16, 32, 64, then powers of two up to MAX_ROWS."""
    return max(16, triton.next_power_of_2(m))


def split_for(m: int, n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Smallest power-of-two split that gives every SM a program, keeping >= 4 K tiles per program."""
    programs = triton.cdiv(m, block_m(m)) * triton.cdiv(n, block_n)
    split = 1
    while programs * split < num_sms and triton.cdiv(k, 2 * split * block_k) >= 4 and split < 8:
        split *= 2
    return split


def candidate_configs(m: int, n: int, k: int, num_sms: int) -> list[SkinnyConfig]:
    """Every tile without split, with the split that fills the SMs, with twice that and with half of it: how
    many programs fit an SM depends on the tile's shared memory, and a last wave that is mostly empty costs
    as much as a full one, so which count wastes least is measured, not guessed. Half the fill: the down
    projection (K 14336) at 8-64 rows ran 2-4 % faster on 128 programs (split 2) than on 256 (split 4) or
    64 (no split) (H100, 2026-11-28), and the fill rule never offered split 2 for 64 strips. The split is a
    runtime argument: it adds no compile beyond split-or-not."""
    out = []
    for bn, bk, warps, stages in TILES:
        fill = split_for(m, n, k, bn, bk, num_sms)
        double = [2 * fill] if fill > 1 and triton.cdiv(k, 2 * fill * bk) >= 4 else []
        half = [fill // 2] if fill >= 4 else []
        for split in sorted({1, *half, fill, *double}):
            fusions = (False, True) if split > 1 and FUSED_SPLIT_SUM else (False,)
            out += [SkinnyConfig(bn, bk, split, warps, stages, fused) for fused in fusions]
    return out


def default_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """Used where nothing was measured (CPU runs, tests, a call without a config)."""
    bn, bk, warps, stages = TILES[0]
    return SkinnyConfig(bn, bk, split_for(m, n, k, bn, bk, num_sms), warps, stages)


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100's count: CPU runs only check that the split paths compute the same result
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _w_tile(w_rows, ks, k_hi, n_mask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """[BLOCK_N, BLOCK_K] weights at columns ks (w_rows: [BLOCK_N, 1] row pointers)."""
    if EVEN_K:  # no K mask: the masks left are constant along K, so loads stay vectorised
        if EVEN_N:  # the weight stream (all of the traffic) unpredicated
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < k_hi)[None, :], other=0.0)
    return w


@triton.jit
def _x_tile(x_cols, ks, k_hi, m_mask, EVEN_K: tl.constexpr):
    """[BLOCK_K, BLOCK_M] of x^T at rows ks (x_cols: [1, BLOCK_M] row pointers of x)."""
    if EVEN_K:
        xt = tl.load(x_cols + ks[:, None], mask=m_mask[None, :], other=0.0)
    else:
        xt = tl.load(x_cols + ks[:, None], mask=(ks < k_hi)[:, None] & m_mask[None, :], other=0.0)
    return xt


@triton.jit
def _mma(w, xt, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        w, xt = w.to(tl.float32), xt.to(tl.float32)
    return tl.dot(w, xt, acc, input_precision=PRECISION)


# fused (0 or 1) is a runtime argument, not a compile-time one: the configs a shape measures at start-up compile
# no second kernel for it (each compile takes seconds, on every new machine).
@triton.jit(do_not_specialize=["M", "k_tiles", "splits", "fused"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, cnt_ptr,  # z, cnt: the output and the tiles' arrival counters (fused only)
    M, N, K, k_tiles, splits, fused,  # k_tiles: BLOCK_K tiles per split (at least one); splits: programs along K
    stride_xm, stride_wn, stride_ym, stride_ys, stride_zm,  # stride_ys: between splits' partials (PARTIAL only)
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    split = tl.program_id(1)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of w, columns of y
    m_mask, n_mask = ms < M, ns < N
    k_lo = split * k_tiles * BLOCK_K
    k_hi = tl.minimum(K, k_lo + k_tiles * BLOCK_K)
    w_rows = w_ptr + ns[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + ms[None, :].to(tl.int64) * stride_xm  # [1, BLOCK_M]
    # The first tile is peeled: its weights (no kernel of a step writes them) stream in before the wait
    # for the previous kernel, whose output x is. (Three tiles so, as registers allowed, made the o and qkv
    # projections 1-1.5 us slower at 8-64 rows and the batch-1 step 2 % slower: H100, 2026-11-28.)
    ks = tl.max_contiguous(tl.multiple_of(k_lo + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    w = _w_tile(w_rows, ks, k_hi, n_mask, EVEN_K, EVEN_N)
    wait_previous(PDL)
    acc = _mma(w, _x_tile(x_cols, ks, k_hi, m_mask, EVEN_K), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32),
               PRECISION, UPCAST)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        ks = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        w = _w_tile(w_rows, ks, k_hi, n_mask, EVEN_K, EVEN_N)
        acc = _mma(w, _x_tile(x_cols, ks, k_hi, m_mask, EVEN_K), acc, PRECISION, UPCAST)
    out_mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:  # fp32 partial of this K range; _sum_splits_kernel, or where fused _sum_tile, finishes the job
        tile_rows = ms[None, :].to(tl.int64) * stride_ym + ns[:, None]  # [BLOCK_N, BLOCK_M] offsets in a partial
        tl.store(y_ptr + split.to(tl.int64) * stride_ys + tile_rows, acc, mask=out_mask)
        if fused != 0:
            _sum_tile(y_ptr, b_ptr, z_ptr, cnt_ptr, tile_rows, ms, ns, n_mask, out_mask, splits, stride_ys, stride_zm,
                      HAS_BIAS, BLOCK_N, BLOCK_M)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + ns, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = y_ptr + ms[None, :].to(tl.int64) * stride_ym + ns[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_tile(p_ptr, b_ptr, z_ptr, cnt_ptr, tile_rows, ms, ns, n_mask, out_mask, splits, stride_ps, stride_zm,
              HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's last split program to arrive sums its partials [splits, BLOCK_N, BLOCK_M] in split order (the sum
    _sum_splits_kernel makes, bit for bit), writes it and resets the tile's counter for the next call. acq_rel: each
    program's partial is visible to whichever arrives last (the barrier first: one thread makes the atomic, and every
    thread's stores must come before it); .cg loads skip an L1 that may hold none of them."""
    tile = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if arrived == splits - 1:
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for s in range(0, splits):
            total += tl.load(p_ptr + s * stride_ps + tile_rows, mask=out_mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + ns, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(z_ptr + ms[None, :].to(tl.int64) * stride_zm + ns[:, None], total.to(z_ptr.dtype.element_ty),
                 mask=out_mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit(do_not_specialize=["splits"])
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, N, splits, stride_ps, stride_pm, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = ns < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):  # in split order: the same sum on every replay
        acc += tl.load(p_ptr + s * stride_ps + row * stride_pm + ns, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + ns, acc.to(y_ptr.dtype.element_ty), mask=mask)


COUNTERS = 1 << 16  # output tiles a fused split sum can count (an 8B step's split products have at most ~2k)
_counters: dict[torch.device, torch.Tensor] = {}


def _counters_of(device: torch.device) -> torch.Tensor:
    """The device's arrival counters of fused split sums (int32 zeros): each tile's last program leaves its own at
    zero, so one buffer serves every product. Products on a device run one after another on its stream (with PDL a
    kernel touches them only after its wait for the one before, whose last programs reset them), which one buffer
    needs. Where the buffer would first be made inside a CUDA-graph capture (the warm-up runs each shape eagerly
    first), a one-element stand-in of that graph's: a product wider than it sums in the second kernel. Every call
    passes counters, fused or not: the kernel's fused branch is compiled whatever the runtime flag, and
    specialises on their int32."""
    buffer = _counters.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(1, dtype=torch.int32, device=device)
        buffer = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buffer


# TRITON_INTERPRET=1 at import time makes @triton.jit return an interpreted function instead.
_INTERPRETED = not isinstance(_skinny_gemm_kernel, triton.runtime.jit.JITFunction)


def skinny_gemm(
    x: torch.Tensor,  # [M, K], unit stride along K
    weight: torch.Tensor,  # [N, K], unit stride along K (nn.Linear layout)
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,  # None: default_config for this shape and device
) -> torch.Tensor:
    """x @ weight^T (+ bias) -> [M, N] in x's dtype, fp32 accumulation."""
    (m, k), (n, w_k) = x.shape, weight.shape
    if w_k != k or weight.dtype != x.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} and bias "
                         f"{None if bias is None else tuple(bias.shape)} disagree")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a unit stride along K")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:  # an empty sum: no tile to peel, no split to make
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    cfg = config or default_config(m, n, k, num_sms(x.device))
    bm = block_m(m)
    tiles = triton.cdiv(k, cfg.block_k)
    k_tiles = triton.cdiv(tiles, cfg.split)  # the last split may get fewer
    splits = triton.cdiv(tiles, k_tiles)  # each with at least one tile: the kernel peels it
    partial = splits > 1
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else y
    # The interpreter's tl.dot multiplies bf16 tiles' raw storage: widen the operands to fp32 there.
    upcast = _INTERPRETED and x.dtype != torch.float32
    grid = (triton.cdiv(m, bm), splits, triton.cdiv(n, cfg.block_n))
    counters = _counters_of(x.device)  # passed whatever the config: the kernel specialises on its pointer's type
    fused = partial and cfg.fused and grid[0] * grid[2] <= min(COUNTERS, counters.numel())
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else y, out, y, counters,
        m, n, k, k_tiles, splits, int(fused), x.stride(0), weight.stride(0), out.stride(-2),
        out.stride(0) if partial else 0, y.stride(0), HAS_BIAS=bias is not None, PARTIAL=partial,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x.device),
    )
    if partial and not fused:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](
            out, bias if bias is not None else y, y, n, splits, out.stride(0), out.stride(1), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl.options(x.device))
    return y
