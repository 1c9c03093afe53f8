"""Lossless verification of a window of drafts (docs/design.md §4), batched over requests.

Sampled rows: accept draft d_j with probability min(1, p_j(d_j) / q'_j(d_j)); at the first rejection
emit a token from norm(max(0, p_j - q'_j)); if every draft is accepted emit the bonus token from
p_{k}. Whatever proposal q' the drafter really sampled from, the emitted tokens are distributed
exactly as p. Greedy rows: accept while the draft equals the target argmax, then emit the argmax.
"""

from __future__ import annotations

import torch

from mtpserve.kernels import use_fused
from mtpserve.kernels.greedy_accept_ref import greedy_accept_ref
from mtpserve.workers.sampling import STREAM_ACCEPT, STREAM_SAMPLE, sample, uniforms


def greedy_accepted(drafts: torch.Tensor, target_argmax: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Drafts [R, K] accepted against the target's argmax [R, K+1], within num_drafts [R] -> [R] int64: an
    accepted draft equals the argmax at its position. One kernel on CUDA."""
    if use_fused(drafts):  # imported here: triton is imported only where a kernel runs
        from mtpserve.kernels.greedy_accept import greedy_accept

        return greedy_accept(drafts, target_argmax, num_drafts)
    return greedy_accept_ref(drafts, target_argmax, num_drafts)


def verify(
    p: torch.Tensor,  # [R, K+1, V] target distributions at each window position
    target_argmax: torch.Tensor,  # [R, K+1]
    draft_ids: torch.Tensor,  # [R, K] (entries past num_drafts are ignored)
    q_ids: torch.Tensor,  # [R, K, M] the drafter's truncated proposal ...
    q_probs: torch.Tensor,  # [R, K, M] ... and its renormalised probabilities
    num_drafts: torch.Tensor,  # [R] int64
    greedy: torch.Tensor,  # [R] bool
    u_accept: torch.Tensor,  # [R, K] uniforms
    u_sample: torch.Tensor,  # [R, K+1] uniforms
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [R, K+1]: accepted drafts then the emitted token at index a, num_accepted a [R])."""
    num_reqs, window, _ = p.shape
    k = window - 1
    rows = torch.arange(num_reqs, device=p.device)
    # q' lives on its M proposals only: no [R, K, V] tensor (at a 152k vocabulary and 256 requests it would be
    # over 600 MB a step). Ids may repeat (zero-probability padding when the vocabulary is smaller than M),
    # so q'(d) is the sum over the proposals equal to d, as a dense scatter_add would hold it.
    p_d = p[:, :k].gather(2, draft_ids[..., None]).squeeze(-1)
    q_d = (q_probs * (q_ids == draft_ids[..., None])).sum(-1)
    accept = torch.where(greedy[:, None], draft_ids == target_argmax[:, :k], u_accept * q_d < p_d)
    accept &= torch.arange(k, device=p.device)[None, :] < num_drafts[:, None]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    # Emit from the residual at the first rejection; at a == num_drafts q is zero, so this is the bonus p.
    p_a = p[rows, num_accepted]
    residual = p_a
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        rejected = (num_accepted < num_drafts)[:, None]
        residual = p_a.scatter_add(1, q_ids[rows, at], -(q_probs[rows, at] * rejected))  # p - q' on the proposals
    residual = residual.clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)  # p == q' up to rounding
    emitted = torch.where(greedy, target_argmax[rows, num_accepted], sample(residual, u_sample[rows, num_accepted]))

    tokens = torch.cat((draft_ids, draft_ids.new_zeros(num_reqs, 1)), dim=1)
    tokens[rows, num_accepted] = emitted
    return tokens, num_accepted


def verify_seeded(
    p: torch.Tensor,  # [R, K+1, V] float32
    target_argmax: torch.Tensor,  # [R, K+1]
    draft_ids: torch.Tensor,  # [R, K]
    q_ids: torch.Tensor,  # [R, K, M]
    q_probs: torch.Tensor,  # [R, K, M]
    num_drafts: torch.Tensor,  # [R] int64
    greedy: torch.Tensor,  # [R] bool
    seed: torch.Tensor,  # [R] int64
    frontier: torch.Tensor,  # [R] int64: the verified tokens before the step
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify() with the counter-based uniforms of each request: draft j's acceptance and the emitted token at
    index a drawn at token index frontier + j (resp. + a). One kernel on CUDA (kernels/rejection_verify.py)."""
    if use_fused(p) and p.dtype == torch.float32:
        from mtpserve.kernels.rejection_verify import rejection_verify

        return rejection_verify(p, target_argmax, draft_ids, q_ids, q_probs, num_drafts, greedy, seed, frontier,
                                STREAM_ACCEPT, STREAM_SAMPLE)
    k, index = draft_ids.shape[1], frontier[:, None] + torch.arange(p.shape[1], device=p.device)
    return verify(p, target_argmax, draft_ids, q_ids, q_probs, num_drafts, greedy,
                  uniforms(seed[:, None], index[:, :k], STREAM_ACCEPT), uniforms(seed[:, None], index, STREAM_SAMPLE))
