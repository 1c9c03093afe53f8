"""Triton block-scaled FP8 linear (weight-only FP8): y = x @ (fp8 weight * per-block scale)^T.

Drop-in for `fp8_linear_ref`. The weight streams from memory as one byte per element, which is what
decode (bound by weight bytes) gains from FP8; each [BLOCK_K, BLOCK_M] tile is widened and scaled in
registers, rounded to x's dtype (as the reference rounds the dequantised weight), and fed to tl.dot
with fp32 accumulation. BLOCK_K divides the quantisation block's K, so a tile needs one scale per
output row: scale_inv[m // BM, k0 // BK].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, M, K,
    stride_xn, stride_wm, stride_sm, stride_yn,
    QUANT_M: tl.constexpr, QUANT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask, col_mask = rows < N, cols < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xn + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wm + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_M] fp8
        scale = tl.load(s_ptr + (cols // QUANT_M) * stride_sm + k0 // QUANT_K, mask=col_mask, other=0.0)  # [BLOCK_M]
        b = (w.to(tl.float32) * scale[None, :]).to(x_ptr.dtype.element_ty)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = y_ptr + rows[:, None].to(tl.int64) * stride_yn + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# TRITON_INTERPRET=1 at import time makes @triton.jit return an interpreted function instead.
_INTERPRETED = not isinstance(_fp8_gemm_kernel, triton.runtime.jit.JITFunction)


def check_fp8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """Raise ValueError unless weight [..., M, K] is float8_e4m3fn, x's K matches, scale_inv is
    [..., ceil(M/BM), ceil(K/BK)] and the blocks are powers of two >= 16 (also the grouped FP8 GEMM's check)."""
    *lead, m, k = weight.shape
    if x.shape[-1] != k or tuple(scale_inv.shape) != (*lead, triton.cdiv(m, block[0]), triton.cdiv(k, block[1])):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and scale_inv "
                         f"{tuple(scale_inv.shape)} disagree for blocks {block}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if any(b < 16 or b & (b - 1) for b in block):
        raise ValueError(f"quantisation block {block}: each side must be a power of two >= 16")


def fp8_linear(
    x: torch.Tensor,  # [N, K]
    weight: torch.Tensor,  # [M, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(M/BM), ceil(K/BK)] fp32
    block: tuple[int, int],  # (BM, BK), each a power of two >= 16
    block_n: int = 32,
    block_m: int = 64,
) -> torch.Tensor:
    """x @ dequantised(weight)^T -> [N, M] in x's dtype."""
    (n, k), (m, _) = x.shape, weight.shape
    quant_m, quant_k = block
    check_fp8(x, weight, scale_inv, block)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a unit stride along K")
    y = torch.empty(n, m, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    scale = scale_inv.float().contiguous()
    # The interpreter's tl.dot multiplies bf16 tiles' raw storage: widen the operands to fp32 there.
    upcast = _INTERPRETED and x.dtype != torch.float32
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _fp8_gemm_kernel[grid](
        x, weight, scale, y, n, m, k,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        QUANT_M=quant_m, QUANT_K=quant_k, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=min(64, quant_k),
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
    )
    return y
