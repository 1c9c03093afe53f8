"""The verification function alone (docs/design.md §4): exact target distribution at every window position."""

from __future__ import annotations

import numpy as np
import torch

from mtpserve.workers.rejection import verify
from tests.stats import ALPHA, chi_square_pvalue

VOCAB, K, M, ROWS = 7, 3, 3, 150_000


def _window(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target distributions p [K+1, V] (with zeros) and sparse proposals q' over M ids per position."""
    p = torch.rand(K + 1, VOCAB, generator=gen) ** 3
    p[:, 0] = 0.0  # a token the target never emits
    p /= p.sum(-1, keepdim=True)
    # Like a real drafter's: mostly the target's likely tokens, with the wrong weights, plus a
    # token the target never emits (so that rejections and residual sampling both happen).
    q_ids = torch.cat((p[:K].topk(M - 1, dim=-1).indices, torch.zeros(K, 1, dtype=torch.long)), dim=1)
    q_probs = torch.rand(K, M, generator=gen) + 0.2
    return p, q_ids, q_probs / q_probs.sum(-1, keepdim=True)


def _run(verify_fn, seed: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p, q_ids, q_probs = _window(gen)
    choice = torch.multinomial(q_probs.repeat(ROWS, 1), 1, generator=gen).view(ROWS, K)
    drafts = q_ids.gather(1, choice.T).T  # [ROWS, K], each d_j ~ q'_j
    num_drafts = torch.randint(0, K + 1, (ROWS,), generator=gen)  # some windows are shorter
    tokens, accepted = verify_fn(
        p.expand(ROWS, -1, -1), p.argmax(-1).expand(ROWS, -1), drafts, q_ids.expand(ROWS, -1, -1),
        q_probs.expand(ROWS, -1, -1), num_drafts, torch.zeros(ROWS, dtype=torch.bool),
        torch.rand(ROWS, K, generator=gen), torch.rand(ROWS, K + 1, generator=gen),
    )
    return tokens.numpy(), accepted.numpy(), p


def _position_pvalues(tokens: np.ndarray, accepted: np.ndarray, p: torch.Tensor) -> list[float]:
    """At each window position j, the token emitted there (by rows that reached j) against p_j."""
    pvalues = []
    for j in range(K + 1):
        reached = accepted >= j
        assert reached.sum() > 5_000, "too few samples at this position for the test to mean anything"
        counts = np.bincount(tokens[reached, j], minlength=VOCAB)
        pvalues.append(chi_square_pvalue(counts, p[j].numpy()))
    return pvalues


def test_emitted_tokens_follow_the_target_at_every_position() -> None:
    tokens, accepted, p = _run(verify, seed=0)
    assert min(_position_pvalues(tokens, accepted, p)) > ALPHA
    assert 0 < accepted.mean() < K  # both acceptances and rejections happened


def _biased_verify(p, argmax, drafts, q_ids, q_probs, num_drafts, greedy, u_accept, u_sample):
    """The classic bug: on rejection, resample from p instead of the residual max(0, p - q')."""
    q = torch.zeros(p.shape[0], K, VOCAB).scatter_(2, q_ids, q_probs)
    p_d = p[:, :K].gather(2, drafts[..., None]).squeeze(-1)
    q_d = q.gather(2, drafts[..., None]).squeeze(-1)
    accept = (u_accept * q_d < p_d) & (torch.arange(K)[None] < num_drafts[:, None])
    accepted = accept.long().cumprod(1).sum(1)
    rows = torch.arange(p.shape[0])
    p_a = p[rows, accepted]
    cdf = p_a.cumsum(-1)
    emitted = torch.searchsorted(cdf, u_sample[rows, accepted, None] * cdf[:, -1:], right=True).squeeze(-1)
    tokens = torch.cat((drafts, drafts[:, :1]), 1)
    tokens[rows, accepted] = emitted.clamp(max=VOCAB - 1)
    return tokens, accepted


def test_the_check_rejects_a_biased_verifier() -> None:
    tokens, accepted, p = _run(_biased_verify, seed=0)
    assert min(_position_pvalues(tokens, accepted, p)) < ALPHA


def test_greedy_rows_accept_exact_matches_and_emit_the_argmax() -> None:
    p = torch.zeros(2, K + 1, VOCAB)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 5], [1, 2, 3]])
    q_ids = torch.zeros(2, K, M, dtype=torch.long)
    q_probs = torch.full((2, K, M), 1.0 / M)
    tokens, accepted = verify(p, argmax, drafts, q_ids, q_probs, torch.tensor([3, 3]), torch.tensor([True, True]),
                              torch.rand(2, K), torch.rand(2, K + 1))
    assert accepted.tolist() == [2, 3]
    assert tokens[0, :3].tolist() == [1, 2, 3]  # two accepted drafts, then the argmax at the mismatch
    assert tokens[1].tolist() == [1, 2, 3, 4]  # all accepted, then the bonus argmax
    tokens, accepted = verify(p, argmax, drafts, q_ids, q_probs, torch.tensor([1, 0]), torch.tensor([True, True]),
                              torch.rand(2, K), torch.rand(2, K + 1))
    assert accepted.tolist() == [1, 0] and tokens[0, :2].tolist() == [1, 2] and tokens[1, 0].item() == 1


def test_zero_probability_padding_of_the_proposal_changes_nothing() -> None:
    """With a vocabulary smaller than M the drafter pads proposals with zero-probability copies of an
    id already present; the verifier must read the real probability, not the padding's zero."""
    gen = torch.Generator().manual_seed(1)
    p, q_ids, q_probs = _window(gen)
    padded_ids = torch.cat((q_ids, q_ids[:, :1].expand(-1, 5)), dim=1)
    padded_probs = torch.cat((q_probs, torch.zeros(K, 5)), dim=1)
    drafts = q_ids[:, 0].expand(64, -1)
    u_acc, u_smp = torch.rand(64, K, generator=gen), torch.rand(64, K + 1, generator=gen)
    args = (p.expand(64, -1, -1), p.argmax(-1).expand(64, -1), drafts)
    rest = (torch.full((64,), K), torch.zeros(64, dtype=torch.bool), u_acc, u_smp)
    plain = verify(*args, q_ids.expand(64, -1, -1), q_probs.expand(64, -1, -1), *rest)
    padded = verify(*args, padded_ids.expand(64, -1, -1), padded_probs.expand(64, -1, -1), *rest)
    assert torch.equal(plain[0], padded[0]) and torch.equal(plain[1], padded[1])


def _dense_verify(p, target_argmax, draft_ids, q_ids, q_probs, num_drafts, greedy, u_accept, u_sample):
    """The textbook form, with q' scattered over the whole vocabulary (what verify avoids building)."""
    from mtpserve.workers.sampling import sample

    num_reqs, window, vocab = p.shape
    k, rows = window - 1, torch.arange(num_reqs)
    q = torch.zeros(num_reqs, k, vocab, dtype=p.dtype).scatter_add_(2, q_ids, q_probs)
    p_d = p[:, :k].gather(2, draft_ids[..., None]).squeeze(-1)
    q_d = q.gather(2, draft_ids[..., None]).squeeze(-1)
    accept = torch.where(greedy[:, None], draft_ids == target_argmax[:, :k], u_accept * q_d < p_d)
    accept &= torch.arange(k)[None, :] < num_drafts[:, None]
    a = accept.long().cumprod(dim=1).sum(dim=1)
    p_a = p[rows, a]
    q_a = q[rows, a.clamp(max=max(k - 1, 0))] * (a < num_drafts)[:, None] if k > 0 else torch.zeros_like(p_a)
    residual = (p_a - q_a).clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
    emitted = torch.where(greedy, target_argmax[rows, a], sample(residual, u_sample[rows, a]))
    tokens = torch.cat((draft_ids, draft_ids.new_zeros(num_reqs, 1)), dim=1)
    tokens[rows, a] = emitted
    return tokens, a


def test_the_proposals_are_never_spread_over_the_vocabulary_and_nothing_changes() -> None:
    """verify keeps q' on its M proposals (a dense [R, K, V] copy is over 600 MB a step at a 152k vocabulary
    and 256 requests); its tokens equal the dense form's bit for bit, padded duplicate ids included."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(200):
        rows, k, vocab, m = 6, 1 + trial % 4, 5 + trial % 30, 4
        p = torch.rand(rows, k + 1, vocab, generator=gen) ** 3
        p /= p.sum(-1, keepdim=True)
        q_ids = torch.stack([torch.randperm(vocab, generator=gen)[:m] for _ in range(rows * k)]).view(rows, k, m)
        q_ids[..., m - 1] = q_ids[..., 0]  # a padded duplicate of entry 0, with zero probability
        q_probs = torch.rand(rows, k, m, generator=gen)
        q_probs[..., m - 1] = 0.0
        q_probs /= q_probs.sum(-1, keepdim=True)
        drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.7, q_ids[..., 0],
                             torch.randint(0, vocab, (rows, k), generator=gen))
        args = (p, p.argmax(-1), drafts, q_ids, q_probs, torch.randint(0, k + 1, (rows,), generator=gen),
                torch.rand(rows, generator=gen) < 0.3, torch.rand(rows, k, generator=gen),
                torch.rand(rows, k + 1, generator=gen))
        tokens, accepted = verify(*args)
        dense_tokens, dense_accepted = _dense_verify(*args)
        assert torch.equal(tokens, dense_tokens) and torch.equal(accepted, dense_accepted), trial
