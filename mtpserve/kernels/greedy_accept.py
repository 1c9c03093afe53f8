"""Triton greedy verification in one launch (drop-in for `greedy_accept_ref`).

In torch the accepted count is six small kernels (compare, mask, cumulative product, sum); a greedy
uniform step runs it once, and at batch 1 its launches cost more than the comparison. One program per
request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["k"])
def _greedy_accept_kernel(drafts_ptr, argmax_ptr, num_drafts_ptr, out_ptr, k, stride_d, stride_a,
                          BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    valid = j < tl.minimum(tl.load(num_drafts_ptr + b), k)
    drafts = tl.load(drafts_ptr + b * stride_d + j, mask=valid, other=0)
    target = tl.load(argmax_ptr + b * stride_a + j, mask=valid, other=0)
    # The first draft that misses (or the first past num_drafts) ends the run of accepted ones.
    miss = tl.where(valid & (drafts == target), BLOCK_K, j)
    tl.store(out_ptr + b, tl.min(miss, axis=0).to(tl.int64))


def greedy_accept(
    drafts: torch.Tensor,  # [B, k] int64
    argmax: torch.Tensor,  # [B, k + 1] int64
    num_drafts: torch.Tensor,  # [B] int64
) -> torch.Tensor:
    """-> accepted [B] int64 (see greedy_accept_ref)."""
    batch, k = drafts.shape
    if argmax.shape != (batch, k + 1) or num_drafts.shape != (batch,):
        raise ValueError(f"argmax {tuple(argmax.shape)} must be [{batch}, {k + 1}] and num_drafts "
                         f"{tuple(num_drafts.shape)} [{batch}] for drafts {tuple(drafts.shape)}")
    out = torch.empty(batch, dtype=torch.int64, device=drafts.device)
    if batch == 0 or k == 0:
        return out.zero_()
    drafts, argmax = (t if t.stride(1) == 1 else t.contiguous() for t in (drafts, argmax))
    # BLOCK_K > k: the sentinel column k always misses, so a run of k accepted drafts reads k.
    _greedy_accept_kernel[(batch,)](drafts, argmax, num_drafts, out, k, drafts.stride(0), argmax.stride(0),
                                    BLOCK_K=triton.next_power_of_2(k + 1), num_warps=1)
    return out
