"""Triton grouped GEMM over rows sorted by expert (the routed experts of an MoE layer).

Drop-in for `grouped_gemm_ref`: x [N, K] with expert e's rows at offsets[e] .. offsets[e+1]-1, weight
[E, M, K] (nn.Linear layout per expert) -> y [N, M], y[i] = x[i] @ weight[expert(i)]^T; rows from
offsets[E] on (routed to another rank's experts) are zero.

Each expert's rows are cut into tiles of BLOCK_N; the tiles of all experts are numbered one after the
other (tile_starts, a prefix sum computed on the device), and program (t, m) finds its expert by
counting the experts whose tiles start at or before t. The grid is sized by the bound
cdiv(N, BLOCK_N) + E on the number of tiles, so the host never reads the group sizes (no device sync,
graph-capturable); programs past the last tile return at once. Every expert's weight is read once per
output tile that routes to it: the cost follows the experts actually used, not all E.

`grouped_gemm_fp8` runs the same kernel over block-scaled FP8 experts (FP8-served MoE layers): each
[BLOCK_K, BLOCK_M] weight tile streams from memory as one byte per element with its per-block scales,
is widened and scaled in registers, rounded to x's dtype (as the reference rounds the dequantised
weight) and fed to tl.dot with fp32 accumulation. Activations stay in x's dtype (weight-only FP8):
decode reads every routed expert's bytes once per step, and halving those bytes is what FP8 buys
there. BLOCK_K divides the quantisation block's K, so a tile needs one scale per output column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mtpserve.kernels.fp8_gemm import check_fp8


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, offsets_ptr, tile_starts_ptr,
    M, K,
    stride_xn, stride_we, stride_wm, stride_se, stride_sm, stride_yn,
    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, FP8: tl.constexpr, QUANT_M: tl.constexpr,
    QUANT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    # Expert of this tile: the last e with tile_starts[e] <= tile (tile_starts[E] = the number of tiles).
    offs_e = tl.arange(0, BLOCK_E)
    starts = tl.load(tile_starts_ptr + 1 + offs_e, mask=offs_e < NUM_EXPERTS, other=2**30)
    expert = tl.sum((starts <= tile).to(tl.int32), axis=0)
    if expert >= NUM_EXPERTS:
        return
    first_tile = tl.load(tile_starts_ptr + expert)
    row_end = tl.load(offsets_ptr + expert + 1)
    rows = tl.load(offsets_ptr + expert) + (tile - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask, col_mask = rows < row_end, cols < M
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = s_ptr + expert.to(tl.int64) * stride_se + (cols // QUANT_M) * stride_sm  # [BLOCK_M]; FP8 only
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xn + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        b = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wm + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
        if FP8:
            scale = tl.load(s_base + k0 // QUANT_K, mask=col_mask, other=0.0)  # [BLOCK_M]
            b = (b.to(tl.float32) * scale[None, :]).to(x_ptr.dtype.element_ty)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = y_ptr + rows[:, None].to(tl.int64) * stride_yn + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# TRITON_INTERPRET=1 at import time makes @triton.jit return an interpreted function instead.
_INTERPRETED = not isinstance(_grouped_gemm_kernel, triton.runtime.jit.JITFunction)


def grouped_gemm(
    x: torch.Tensor,  # [N, K], rows sorted by expert
    weight: torch.Tensor,  # [E, M, K]
    offsets: torch.Tensor,  # [E + 1] int64, expert e owns rows offsets[e] .. offsets[e+1]-1; offsets[E] <= N
    block_n: int = 32,
    block_m: int = 64,
    block_k: int = 32,
) -> torch.Tensor:
    """y [N, M] with y[i] = x[i] @ weight[expert of row i]^T (fp32 accumulation, output in x's dtype)."""
    num_experts, m, w_k = weight.shape
    if w_k != x.shape[1] or offsets.shape != (num_experts + 1,):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and offsets {tuple(offsets.shape)} disagree")
    return _launch(x, weight, None, offsets, (1, block_k), (block_n, block_m, block_k))


def grouped_gemm_fp8(
    x: torch.Tensor,  # [N, K], rows sorted by expert
    weight: torch.Tensor,  # [E, M, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [E, ceil(M/BM), ceil(K/BK)] fp32
    offsets: torch.Tensor,  # [E + 1] int64; offsets[E] <= N
    block: tuple[int, int],  # (BM, BK), each a power of two >= 16
    block_n: int = 32,
    block_m: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y [N, M] with y[i] = x[i] @ dequantised(weight[expert of row i])^T; drop-in for grouped_gemm_fp8_ref."""
    check_fp8(x, weight, scale_inv, block)
    if offsets.shape != (weight.shape[0] + 1,):
        raise ValueError(f"offsets {tuple(offsets.shape)} disagree with weight {tuple(weight.shape)}")
    return _launch(x, weight, scale_inv.float().contiguous(), offsets, block, (block_n, block_m, min(block_k, block[1])))


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, offsets: torch.Tensor,
            quant: tuple[int, int], tile: tuple[int, int, int]) -> torch.Tensor:
    """Run the kernel (FP8 when `scale` is given) over the expert tiles; shapes already checked."""
    if x.stride(1) != 1 or weight.stride(2) != 1:
        raise ValueError("x and weight need a unit stride along K")
    (num_rows, k), (num_experts, m, _), (block_n, block_m, block_k) = x.shape, weight.shape, tile
    y = torch.zeros(num_rows, m, dtype=x.dtype, device=x.device)  # zeros: rows past offsets[E] stay 0
    if num_rows == 0:
        return y
    tiles = (offsets[1:] - offsets[:-1] + block_n - 1) // block_n
    tile_starts = F.pad(torch.cumsum(tiles, 0), (1, 0))
    # The interpreter's tl.dot multiplies bf16 tiles' raw storage: widen the operands to fp32 there.
    upcast = _INTERPRETED and x.dtype != torch.float32
    s = weight if scale is None else scale  # never read without FP8
    s_strides = (0, 0) if scale is None else (scale.stride(0), scale.stride(1))
    grid = (triton.cdiv(num_rows, block_n) + num_experts, triton.cdiv(m, block_m))
    _grouped_gemm_kernel[grid](
        x, weight, s, y, offsets, tile_starts, m, k,
        x.stride(0), weight.stride(0), weight.stride(1), *s_strides, y.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), FP8=scale is not None,
        QUANT_M=quant[0], QUANT_K=quant[1], BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
    )
    return y
