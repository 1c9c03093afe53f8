"""rejection_verify: the Triton kernel against workers/rejection.py's torch verification (the oracle, itself
tested for losslessness in tests/workers/test_rejection.py), with the same counter-based uniforms.

Interpreted on CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.sampling import STREAM_ACCEPT, STREAM_SAMPLE, uniforms
from mtpserve.workers.rejection import verify

ARGS = ("p", "argmax", "drafts", "q_ids", "q_probs", "num_drafts", "greedy", "seed", "frontier")


def _case(seed: int, reqs: int, k: int, vocab: int, m: int, same_q: bool = False) -> dict[str, torch.Tensor]:
    """Target distributions p, and drafts drawn from a top-m proposal q' of a nearby distribution."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(reqs, k + 1, vocab, generator=gen) * 2
    p = torch.softmax(logits, -1)
    q_logits = logits[:, :k] + (0 if same_q else 0.5 * torch.randn(reqs, k, vocab, generator=gen))
    values, q_ids = q_logits.topk(min(m, vocab), dim=-1)
    q_probs = torch.softmax(values, -1)
    if same_q:  # q' twice p everywhere: every rejection leaves no residual at all
        q_probs = 2 * p[:, :k].gather(2, q_ids)
    pick = torch.multinomial(q_probs.reshape(-1, q_probs.shape[-1]), 1, generator=gen).view(reqs, k)
    drafts = q_ids.gather(2, pick[..., None])[..., 0]
    return dict(p=p, argmax=logits.argmax(-1), drafts=drafts, q_ids=q_ids, q_probs=q_probs,
                num_drafts=torch.randint(0, k + 1, (reqs,), generator=gen), greedy=torch.rand(reqs, generator=gen) < 0.3,
                seed=torch.randint(0, 1 << 40, (reqs,), generator=gen), frontier=torch.randint(5, 900, (reqs,), generator=gen))


def _oracle(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    k = c["drafts"].shape[1]
    index = c["frontier"][:, None] + torch.arange(k + 1)
    return verify(c["p"], c["argmax"], c["drafts"], c["q_ids"], c["q_probs"], c["num_drafts"], c["greedy"],
                  uniforms(c["seed"][:, None], index[:, :k], STREAM_ACCEPT),
                  uniforms(c["seed"][:, None], index, STREAM_SAMPLE))


@pytest.mark.parametrize("reqs,k,vocab,m,block_v", [(9, 3, 50, 8, 16), (5, 1, 300, 32, 64), (16, 4, 700, 16, 128),
                                                     (7, 0, 40, 8, 16), (6, 8, 100, 32, 1024)])
def test_kernel_matches_the_torch_verification(kernels, reqs, k, vocab, m, block_v):
    from mtpserve.kernels.rejection_verify import rejection_verify

    c = _case(reqs * 100 + k * 10 + m, reqs, k, vocab, m)
    want_tokens, want_accepted = _oracle(c)
    tokens, accepted = rejection_verify(*(c[a].to(kernels.device) for a in ARGS), STREAM_ACCEPT, STREAM_SAMPLE,
                                        block_v=block_v)
    assert torch.equal(accepted.cpu(), want_accepted)
    for r, a in enumerate(want_accepted.tolist()):  # past index a nothing is read
        assert tokens[r, : a + 1].tolist() == want_tokens[r, : a + 1].tolist(), f"request {r}"
    assert 0 < want_accepted.float().mean() < k or k == 0  # the case exercises both outcomes


@pytest.mark.parametrize("seed,vocab,block_v", [(11, 8, 1024), (0, 300, 64), (3, 300, 64)])
def test_kernel_draws_from_p_where_the_residual_vanishes(kernels, seed, vocab, block_v):
    """q' above p on the whole vocabulary: a rejection leaves max(0, p - q') = 0, where the torch form draws
    from p instead: the kernel too, over one vocabulary block or several (summed as sum(p) - sum(min(p, q'))
    per block, the zero residual left rounding noise and the draw fell on a block's first token)."""
    from mtpserve.kernels.rejection_verify import rejection_verify

    c = _case(seed, 12, 2, vocab, vocab, same_q=True)  # m = vocab: q' covers every token
    c["greedy"][:] = False
    c["num_drafts"][:] = 2
    want_tokens, want_accepted = _oracle(c)
    assert (want_accepted < 2).sum() >= 6  # rejections happen (each draft is kept with probability 1/2)
    tokens, accepted = rejection_verify(*(c[a].to(kernels.device) for a in ARGS), STREAM_ACCEPT, STREAM_SAMPLE,
                                        block_v=block_v)
    assert torch.equal(accepted.cpu(), want_accepted)
    for r, a in enumerate(want_accepted.tolist()):
        assert tokens[r, a] == want_tokens[r, a]


def test_kernel_rejects_mismatched_shapes(kernels):
    from mtpserve.kernels.rejection_verify import rejection_verify

    c = {a: t.to(kernels.device) for a, t in _case(1, 2, 2, 20, 4).items()}
    with pytest.raises(ValueError, match="draft_ids"):
        rejection_verify(c["p"], c["argmax"], c["drafts"][:, :1], c["q_ids"], c["q_probs"], c["num_drafts"],
                         c["greedy"], c["seed"], c["frontier"], STREAM_ACCEPT, STREAM_SAMPLE)
