"""Triton lossless verification of each request's drafts (drop-in for workers/rejection.py's `verify` with its
uniforms drawn from (seed, frontier), as `verify_seeded` draws them).

In torch a sampled verification was about forty small kernels (the acceptance tests, the residual
max(0, p - q') on a copy of p, its inverse CDF) plus the uniforms; two launches do it here:

* `_residual_sums_kernel`, one program per (request, vocabulary block): the block's mass of p at the first
  rejected position a, and of the residual, which is p with that position's proposals taken off
  (max(0, p - q') on the M proposal ids, entry by entry);
* `_draw_kernel`, one program per request: the acceptances, and the emitted token by inverse CDF, first
  over the block masses, then inside the one block the draw falls in.

One program per request scanning the whole vocabulary took 0.20 ms at batch 1 and 151936 tokens on an
H100, twice torch's forty kernels (run 68): a lone program's chunk loop is latency-bound. Both kernels
decide the acceptances themselves (a handful of loads), so nothing passes between them but the masses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels.counter_uniforms import counter_uniform
from mtpserve.kernels.counter_uniforms_ref import GOLDEN, M1, M2


@triton.jit
def _first_rejected(p_row, argmax_ptr, drafts_ptr, q_ids_ptr, q_probs_ptr, num_drafts_ptr, r, k, m, vocab, stride_d,
                    n0, seed, greedy, accept_stream, golden, m1, m2, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """(a: the first draft rejected, or the drafts' count; j; drafts [BLOCK_W]; argmax [BLOCK_W]) of request r."""
    w = k + 1
    j = tl.arange(0, BLOCK_W)  # window positions; drafts at j < k
    is_draft = j < k
    drafts = tl.load(drafts_ptr + r * stride_d + j, mask=is_draft, other=0)
    argmax = tl.load(argmax_ptr + r * w + j, mask=j < w, other=-1)
    # Acceptance of every draft at once: u q'(d) < p(d), q'(d) summed over the proposals equal to d.
    mm = tl.arange(0, BLOCK_M)
    qmask = is_draft[:, None] & (mm[None, :] < m)
    q_off = (r * k + j[:, None]) * m + mm[None, :]
    q_ids = tl.load(q_ids_ptr + q_off, mask=qmask, other=-1)
    q_probs = tl.load(q_probs_ptr + q_off, mask=qmask, other=0.0)
    q_d = tl.sum(tl.where(q_ids == drafts[:, None], q_probs, 0.0), 1)
    p_d = tl.load(p_row + j * vocab + drafts, mask=is_draft, other=0.0)
    u_accept = counter_uniform(seed, n0 + j, accept_stream, golden, m1, m2)
    accept = tl.where(greedy != 0, drafts == argmax, u_accept * q_d < p_d)
    accept = accept & is_draft & (j < tl.load(num_drafts_ptr + r))
    a = tl.min(tl.where(accept, BLOCK_W, j), 0)  # a <= k
    return a, j, drafts, argmax


@triton.jit
def _block(p_a, q_ids_ptr, q_probs_ptr, r, k, m, at, own, blk, vocab, BLOCK_V: tl.constexpr):
    """(offsets, p, the residual; each [BLOCK_V]) over vocabulary block blk: p less q' on the rejected position
    at's proposals where `own`, entry by entry and clamped at 0, as the torch form builds it. Summed as
    sum(p) - sum(min(p, q')) instead, a residual that is 0 everywhere (q' >= p) left rounding noise in each
    block, and the draw fell on an entry of mass 0."""
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk = tl.load(p_a + offs, mask=offs < vocab, other=0.0)
    residual = chunk
    if own:
        base, lo = (r * k + at) * m, blk * BLOCK_V
        for i in range(0, m):  # M scalar proposals: no [BLOCK_V, M] tile
            qid = tl.load(q_ids_ptr + base + i)
            # Only the proposals inside this block touch it: a block of 1024 among 148 holds about one of the 32,
            # and comparing the whole block with each proposal took the batch-256 verification 0.10 -> 0.32 ms.
            if (qid >= lo) & (qid < lo + BLOCK_V):
                qp = tl.maximum(tl.load(q_probs_ptr + base + i), 0.0)
                residual = tl.where(offs == qid, tl.maximum(residual - qp, 0.0), residual)
    return offs, chunk, residual


@triton.jit(do_not_specialize=["k", "m", "vocab", "num_blocks"])
def _residual_sums_kernel(
    p_ptr, argmax_ptr, drafts_ptr, q_ids_ptr, q_probs_ptr, num_drafts_ptr, greedy_ptr, seed_ptr, frontier_ptr,
    sums_ptr, k, m, vocab, num_blocks, stride_d, accept_stream, golden, m1, m2,
    BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # grid (R, num_blocks); sums [R, 2, num_blocks]: the block's mass of p at a, and of the residual
    r, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    greedy = tl.load(greedy_ptr + r)
    if greedy == 0:
        p_row = p_ptr + r * (k + 1) * vocab
        a, j, drafts, argmax = _first_rejected(
            p_row, argmax_ptr, drafts_ptr, q_ids_ptr, q_probs_ptr, num_drafts_ptr, r, k, m, vocab, stride_d,
            tl.load(frontier_ptr + r), tl.load(seed_ptr + r), greedy, accept_stream, golden, m1, m2, BLOCK_W, BLOCK_M)
        rejected = (a < tl.load(num_drafts_ptr + r)) & (k > 0)
        _, chunk, residual = _block(p_row + a * vocab, q_ids_ptr, q_probs_ptr, r, k, m, tl.minimum(a, k - 1),
                                    rejected, blk, vocab, BLOCK_V)
        tl.store(sums_ptr + (r * 2) * num_blocks + blk, tl.sum(chunk, 0))
        tl.store(sums_ptr + (r * 2 + 1) * num_blocks + blk, tl.sum(residual, 0))


@triton.jit(do_not_specialize=["k", "m", "vocab", "num_blocks"])
def _draw_kernel(
    p_ptr, argmax_ptr, drafts_ptr, q_ids_ptr, q_probs_ptr, num_drafts_ptr, greedy_ptr, seed_ptr, frontier_ptr,
    sums_ptr, tokens_ptr, accepted_ptr, k, m, vocab, num_blocks, stride_d, accept_stream, sample_stream,
    golden, m1, m2, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # grid (R,); tokens [R, K+1]: the accepted drafts, then the emitted token at index a; accepted [R]: a
    r = tl.program_id(0).to(tl.int64)
    n0, seed, greedy = tl.load(frontier_ptr + r), tl.load(seed_ptr + r), tl.load(greedy_ptr + r)
    p_row = p_ptr + r * (k + 1) * vocab
    a, j, drafts, argmax = _first_rejected(
        p_row, argmax_ptr, drafts_ptr, q_ids_ptr, q_probs_ptr, num_drafts_ptr, r, k, m, vocab, stride_d,
        n0, seed, greedy, accept_stream, golden, m1, m2, BLOCK_W, BLOCK_M)
    emitted = tl.sum(tl.where(j == a, argmax, 0), 0)
    if greedy == 0:
        b = tl.arange(0, BLOCK_B)
        p_mass = tl.load(sums_ptr + (r * 2) * num_blocks + b, mask=b < num_blocks, other=0.0)
        r_mass = tl.load(sums_ptr + (r * 2 + 1) * num_blocks + b, mask=b < num_blocks, other=0.0)
        use_residual = tl.sum(r_mass, 0) > 0  # else p == q' wherever p has mass: draw from p
        masses = tl.where(use_residual, r_mass, p_mass)
        target = counter_uniform(seed, n0 + a, sample_stream, golden, m1, m2) * tl.sum(masses, 0)
        # The block the draw falls in: the blocks whose cumulative mass is <= target lie wholly below it.
        cum = tl.cumsum(masses, 0)
        blk = tl.sum(((cum <= target) & (b < num_blocks)).to(tl.int32), 0)
        blk = tl.minimum(blk, tl.max(tl.where(masses > 0, b, 0), 0))  # past the end by rounding: the last with mass
        carry = tl.sum(tl.where(b < blk, masses, 0.0), 0)
        # Inside it, the same entries the block's mass summed.
        rejected = (a < tl.load(num_drafts_ptr + r)) & (k > 0) & use_residual
        offs, _, residual = _block(p_row + a * vocab, q_ids_ptr, q_probs_ptr, r, k, m, tl.minimum(a, k - 1),
                                   rejected, blk, vocab, BLOCK_V)  # residual: p itself when not use_residual
        cdf = tl.cumsum(residual, 0) + carry
        below = blk * BLOCK_V + tl.sum(((cdf <= target) & (offs < vocab)).to(tl.int32), 0)
        # A target past the block's cumsum by rounding (its mass was a tree sum): the block's last entry with mass.
        last = tl.max(tl.where(residual > 0, offs, -1), 0)
        emitted = tl.where(last >= 0, tl.minimum(below, last), tl.minimum(below, vocab - 1)).to(tl.int64)
    tokens = tl.where(j == a, emitted, tl.where(j < k, drafts, 0))
    tl.store(tokens_ptr + r * (k + 1) + j, tokens, mask=j < k + 1)
    tl.store(accepted_ptr + r, a.to(tl.int64))


def rejection_verify(
    p: torch.Tensor,  # [R, K+1, V] float32, contiguous: target distributions at each window position
    target_argmax: torch.Tensor,  # [R, K+1] int64, contiguous
    draft_ids: torch.Tensor,  # [R, K] int64 (entries past num_drafts are ignored)
    q_ids: torch.Tensor,  # [R, K, M] int64, contiguous
    q_probs: torch.Tensor,  # [R, K, M] float32, contiguous
    num_drafts: torch.Tensor,  # [R] int64
    greedy: torch.Tensor,  # [R] bool
    seed: torch.Tensor,  # [R] int64
    frontier: torch.Tensor,  # [R] int64: draft j's uniforms are drawn at token index frontier + j
    accept_stream: int,
    sample_stream: int,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [R, K+1]: accepted drafts then the emitted token at index a, num_accepted a [R])."""
    num_reqs, window, vocab = p.shape
    k, m = window - 1, q_ids.shape[-1]
    if p.dtype != torch.float32 or draft_ids.shape != (num_reqs, k) or q_probs.shape != q_ids.shape \
            or q_ids.shape[:2] != (num_reqs, k):
        raise ValueError(f"p {tuple(p.shape)} must be float32 [R, K+1, V] and draft_ids {tuple(draft_ids.shape)}, "
                         f"q_ids {tuple(q_ids.shape)}, q_probs {tuple(q_probs.shape)} of its R requests and K drafts")
    p, target_argmax, q_ids, q_probs = (t.contiguous() for t in (p, target_argmax, q_ids, q_probs))
    draft_ids = draft_ids if draft_ids.stride(-1) == 1 else draft_ids.contiguous()
    tokens = torch.empty(num_reqs, window, dtype=torch.int64, device=p.device)
    accepted = torch.empty(num_reqs, dtype=torch.int64, device=p.device)
    if num_reqs == 0:
        return tokens, accepted
    block_v = min(block_v, triton.next_power_of_2(vocab))
    num_blocks = triton.cdiv(vocab, block_v)
    sums = torch.empty(num_reqs, 2, num_blocks, dtype=torch.float32, device=p.device)
    greedy = greedy.view(torch.int8)
    args = (p, target_argmax, draft_ids, q_ids, q_probs, num_drafts, greedy, seed, frontier)
    blocks = dict(BLOCK_W=triton.next_power_of_2(window), BLOCK_M=triton.next_power_of_2(max(m, 1)), BLOCK_V=block_v)
    _residual_sums_kernel[(num_reqs, num_blocks)](
        *args, sums, k, m, vocab, num_blocks, draft_ids.stride(0), accept_stream, GOLDEN, M1, M2, **blocks, num_warps=4)
    _draw_kernel[(num_reqs,)](
        *args, sums, tokens, accepted, k, m, vocab, num_blocks, draft_ids.stride(0), accept_stream, sample_stream,
        GOLDEN, M1, M2, **blocks, BLOCK_B=triton.next_power_of_2(num_blocks), num_warps=4)
    return tokens, accepted
