"""Triton input of an MTP module in one launch (drop-in for `mtp_input_ref`).

Unfused, every module pass builds eh_proj's input with about eight launches: the embedding lookup,
the compare and masked_fill of position 0, the cat shifting the carried hidden row in front of the
previous module's rows, the copy of the strided token view, two RMSNorms and the cat of the halves.
On small models each is a couple of microseconds of a pass that is mostly launches. One program per
output row (b, i) gathers its embedding row and its hidden row straight from the strided inputs and
writes both normed halves. Each half rounds as the Triton RMSNorm does (rmsnorm.py): normalised in
fp32, rounded to the input dtype, weighted in fp32, so the fused and unfused CUDA paths agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _weighted_norm(x, w_ptr, eps, offs, ok, H: tl.constexpr):
    """One row x [BLOCK_H] in its dtype -> w * rmsnorm(x) in fp32, rounded as _rms_norm_kernel rounds."""
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)  # a zero row (masked position 0) stays zero
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    return tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) * normed


# q and the strides stay runtime ints even when 1 (decode windows, a [B, 1] token column): Triton would fold
# a 1 into a constant, the fold that broke a kernel's GPU build before (window_metadata.py). It also drops the
# strides' alignment hints, so the row loads are not vectorised: about 4% at 8192 rows of 4096 on an H100.
@triton.jit(do_not_specialize=["q", "stride_tb", "stride_tq", "stride_e", "stride_pb", "stride_pp", "stride_f"])
def _mtp_input_kernel(
    out_ptr, ids_ptr, pos_ptr, embed_ptr, prev_ptr, first_ptr, ew_ptr, hw_ptr, eps, q,
    stride_tb, stride_tq, stride_e, stride_pb, stride_pp, stride_f,
    H: tl.constexpr, BLOCK_H: tl.constexpr, MASK_POS0: tl.constexpr, SHIFTED: tl.constexpr,
    HIDDEN_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * q + i
    b, i = row // q, row % q
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    token = tl.load(ids_ptr + b * stride_tb + i * stride_tq).to(tl.int64)
    keep = ok
    if MASK_POS0:
        keep = ok & (tl.load(pos_ptr + row) != 0)  # position 0: a zero row, its embedding never read
    emb = tl.load(embed_ptr + token * stride_e + offs, mask=keep, other=0.0)  # [BLOCK_H]
    if SHIFTED:  # row (b, 0) takes the carried row, (b, i) the previous rows' i - 1
        if i == 0:
            src = first_ptr + b * stride_f
        else:
            src = prev_ptr + b * stride_pb + (i - 1) * stride_pp
    else:
        src = prev_ptr + b * stride_pb + i * stride_pp
    hidden = tl.load(src + offs, mask=ok, other=0.0)  # [BLOCK_H]
    e = _weighted_norm(emb, ew_ptr, eps, offs, ok, H).to(out_ptr.dtype.element_ty)
    h = _weighted_norm(hidden, hw_ptr, eps, offs, ok, H).to(out_ptr.dtype.element_ty)
    dst = out_ptr + row * (2 * H) + offs  # [BLOCK_H] of the row's first half
    if HIDDEN_FIRST:
        tl.store(dst, h, mask=ok)
        tl.store(dst + H, e, mask=ok)
    else:
        tl.store(dst, e, mask=ok)
        tl.store(dst + H, h, mask=ok)


def _check(token_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, prev_hidden: torch.Tensor,
           first_hidden: torch.Tensor | None, enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor) -> None:
    """Raise ValueError, naming the argument, where the inputs do not fit the kernel's layout."""
    ints = (torch.int32, torch.int64)
    if token_ids.dim() != 2 or token_ids.dtype not in ints:
        raise ValueError(f"token_ids must be [B, Q] int64 or int32, got {tuple(token_ids.shape)} {token_ids.dtype}")
    (batch, q), hidden_size = token_ids.shape, embed.shape[-1]
    if positions.shape != (batch * q,) or positions.dtype not in ints or positions.stride(0) != 1:
        raise ValueError(f"positions must be [{batch * q}] contiguous int64 or int32, got {tuple(positions.shape)}")
    if embed.dim() != 2 or embed.stride(1) != 1:
        raise ValueError(f"embed must be [V, H] with a unit stride along H, got {tuple(embed.shape)}")
    need = q if first_hidden is None else q - 1
    if (prev_hidden.dim() != 3 or prev_hidden.shape[0] != batch or prev_hidden.shape[1] < need
            or prev_hidden.shape[2] != hidden_size or prev_hidden.stride(2) != 1 or prev_hidden.dtype != embed.dtype):
        raise ValueError(f"prev_hidden {tuple(prev_hidden.shape)} {prev_hidden.dtype} must be [{batch}, >= {need}, "
                         f"{hidden_size}] in embed's dtype {embed.dtype} with a unit stride along H")
    if first_hidden is not None and (first_hidden.shape != (batch, hidden_size) or first_hidden.stride(1) != 1
                                     or first_hidden.dtype != embed.dtype):
        raise ValueError(f"first_hidden {tuple(first_hidden.shape)} {first_hidden.dtype} must be [{batch}, "
                         f"{hidden_size}] in embed's dtype with a unit stride along H")
    if enorm_weight.shape != (hidden_size,):
        raise ValueError(f"enorm_weight {tuple(enorm_weight.shape)} does not fit rows of {hidden_size}")
    if hnorm_weight.shape != (hidden_size,) or hnorm_weight.dtype != enorm_weight.dtype:
        raise ValueError(f"hnorm_weight {tuple(hnorm_weight.shape)} {hnorm_weight.dtype} must be [{hidden_size}] "
                         f"in enorm_weight's dtype {enorm_weight.dtype}")
    tensors = (token_ids, positions, prev_hidden, first_hidden, enorm_weight, hnorm_weight)
    if any(t is not None and t.device != embed.device for t in tensors):
        raise ValueError(f"token_ids, positions, prev_hidden, first_hidden and the weights must be on embed's device "
                         f"{embed.device}")


def mtp_input(token_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, prev_hidden: torch.Tensor,
              first_hidden: torch.Tensor | None, enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float,
              mask_position0: bool, hidden_first: bool) -> torch.Tensor:
    """Rows of eh_proj's input, [B * Q, 2 * H] contiguous (shapes in mtp_input_ref.py). The output takes embed's
    dtype where the weights share it, else the promoted one, as rms_norm's does. Token ids are not
    bounds-checked (that would need a device sync)."""
    _check(token_ids, positions, embed, prev_hidden, first_hidden, enorm_weight, hnorm_weight)
    (batch, q), hidden_size = token_ids.shape, embed.shape[1]
    dtype = embed.dtype if enorm_weight.dtype == embed.dtype else torch.promote_types(embed.dtype, enorm_weight.dtype)
    out = torch.empty((batch * q, 2 * hidden_size), dtype=dtype, device=embed.device)
    if out.numel() == 0:
        return out
    first = prev_hidden if first_hidden is None else first_hidden
    block = triton.next_power_of_2(hidden_size)
    _mtp_input_kernel[(batch * q,)](
        out, token_ids, positions, embed, prev_hidden, first, enorm_weight, hnorm_weight, eps, q,
        token_ids.stride(0), token_ids.stride(1), embed.stride(0), prev_hidden.stride(0), prev_hidden.stride(1),
        0 if first_hidden is None else first_hidden.stride(0),
        H=hidden_size, BLOCK_H=block, MASK_POS0=mask_position0, SHIFTED=first_hidden is not None,
        HIDDEN_FIRST=hidden_first, num_warps=min(16, max(1, block // 256)),
    )
    return out
