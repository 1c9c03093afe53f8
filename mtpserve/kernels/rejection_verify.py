"""Triton lossless verification of each request's drafts in one launch (drop-in for workers/rejection.py's
`verify` with its uniforms drawn from (seed, frontier), as `verify_seeded` draws them).

In torch a sampled verification was about forty small kernels (the acceptance tests, the residual
max(0, p - q') on a copy of p, its inverse CDF) plus the uniforms; one program per request does it
here. The residual is p with the rejected position's proposals taken off: its mass is sum(p) minus
sum(min(p, q')) over the M proposals, and the inverse CDF scans a per-request scratch row (p copied,
the M proposal entries rewritten), chunk by chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels.counter_uniforms import counter_uniform
from mtpserve.kernels.counter_uniforms_ref import GOLDEN, M1, M2


@triton.jit(do_not_specialize=["k", "m", "vocab"])
def _rejection_verify_kernel(
    p_ptr, argmax_ptr, drafts_ptr, q_ids_ptr, q_probs_ptr, num_drafts_ptr, greedy_ptr, seed_ptr, frontier_ptr,
    tokens_ptr, accepted_ptr, scratch_ptr, k, m, vocab, stride_d, accept_stream, sample_stream, golden, m1, m2,
    BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    w = k + 1
    j = tl.arange(0, BLOCK_W)  # window positions; drafts at j < k
    is_draft = j < k
    drafts = tl.load(drafts_ptr + r * stride_d + j, mask=is_draft, other=0)
    n0 = tl.load(frontier_ptr + r)
    seed = tl.load(seed_ptr + r)
    greedy = tl.load(greedy_ptr + r)
    p_row = p_ptr + r * w * vocab
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
    a = tl.min(tl.where(accept, BLOCK_W, j), 0)  # the first draft rejected (or past the drafts): a <= k

    # The emitted token: the argmax for greedy rows, else an inverse-CDF draw from the residual at a.
    emitted = tl.sum(tl.where(j == a, argmax, 0), 0)
    if greedy == 0:
        rejected = a < tl.load(num_drafts_ptr + r)
        at = tl.minimum(a, k - 1)
        p_a = p_row + a * vocab
        scratch = scratch_ptr + r * vocab
        offs = tl.arange(0, BLOCK_V)
        total = 0.0
        for start in range(0, vocab, BLOCK_V):
            chunk = tl.load(p_a + start + offs, mask=start + offs < vocab, other=0.0)
            tl.store(scratch + start + offs, chunk, mask=start + offs < vocab)
            total += tl.sum(chunk, 0)
        # The rejected position's proposals (ids unique where their probability is positive; padding has 0).
        own = (mm < m) & rejected & (k > 0)
        ids = tl.load(q_ids_ptr + (r * k + at) * m + mm, mask=own, other=0)
        qp = tl.load(q_probs_ptr + (r * k + at) * m + mm, mask=own, other=0.0)
        p_ids = tl.load(p_a + ids, mask=own, other=0.0)
        taken = tl.minimum(p_ids, tl.where(qp > 0, qp, 0.0))
        residual_mass = total - tl.sum(taken, 0)
        if residual_mass > 0:  # else p == q' up to rounding: draw from p
            tl.debug_barrier()  # the copy above is every thread's; these entries go over it
            tl.store(scratch + ids, p_ids - taken, mask=own & (qp > 0))
            total = residual_mass
        tl.debug_barrier()
        target = counter_uniform(seed, n0 + a, sample_stream, golden, m1, m2) * total
        below = 0  # entries whose cumulative mass is <= target: the draw's index (searchsorted, right)
        carry = 0.0
        for start in range(0, vocab, BLOCK_V):
            chunk = tl.load(scratch + start + offs, mask=start + offs < vocab, other=0.0)
            cdf = tl.cumsum(chunk, 0) + carry
            below += tl.sum(((cdf <= target) & (start + offs < vocab)).to(tl.int32), 0)
            carry += tl.sum(chunk, 0)
        emitted = tl.minimum(below, vocab - 1).to(tl.int64)

    # Drafts, then the emitted token at a (what lies past a is never read).
    tokens = tl.where(j == a, emitted, tl.where(is_draft, drafts, 0))
    tl.store(tokens_ptr + r * w + j, tokens, mask=j < w)
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
    scratch = torch.empty(num_reqs, vocab, dtype=torch.float32, device=p.device)
    _rejection_verify_kernel[(num_reqs,)](
        p, target_argmax, draft_ids, q_ids, q_probs, num_drafts, greedy.view(torch.int8), seed, frontier,
        tokens, accepted, scratch, k, m, vocab, draft_ids.stride(0), accept_stream, sample_stream, GOLDEN, M1, M2,
        BLOCK_W=triton.next_power_of_2(window), BLOCK_M=triton.next_power_of_2(max(m, 1)),
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)), num_warps=4,
    )
    return tokens, accepted
