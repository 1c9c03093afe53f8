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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr, tile_starts_ptr,
    M, K,
    stride_xn, stride_we, stride_wm, stride_yn,
    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xn + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        b = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wm + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
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
    num_rows, k = x.shape
    num_experts, m, w_k = weight.shape
    if w_k != k or offsets.shape != (num_experts + 1,):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and offsets {tuple(offsets.shape)} disagree")
    if x.stride(1) != 1 or weight.stride(2) != 1:
        raise ValueError("x and weight need a unit stride along K")
    y = torch.zeros(num_rows, m, dtype=x.dtype, device=x.device)  # zeros: rows past offsets[E] stay 0
    if num_rows == 0:
        return y
    tiles = (offsets[1:] - offsets[:-1] + block_n - 1) // block_n
    tile_starts = F.pad(torch.cumsum(tiles, 0), (1, 0))
    # The interpreter's tl.dot multiplies bf16 tiles' raw storage: widen the operands to fp32 there.
    upcast = _INTERPRETED and x.dtype != torch.float32
    grid = (triton.cdiv(num_rows, block_n) + num_experts, triton.cdiv(m, block_m))
    _grouped_gemm_kernel[grid](
        x, weight, y, offsets, tile_starts, m, k,
        x.stride(0), weight.stride(0), weight.stride(1), y.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
    )
    return y
