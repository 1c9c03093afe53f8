"""draft_sample: the Triton kernel against the torch reference, and the reference against the definition
(the request's tempered distribution truncated to its top M and renormalised, sampled by inverse CDF).

Interpreted on CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.counter_uniforms_ref import counter_uniforms_ref
from mtpserve.kernels.draft_sample_ref import draft_sample_ref

STREAM = 1


def _case(seed: int, batch: int, vocab: int, m: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    values, ids = logits.topk(m, dim=-1)
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.2
    greedy = torch.rand(batch, generator=gen) < 0.25
    temperature = torch.where(greedy, 1.0, temperature)
    seeds = torch.randint(0, 1 << 40, (batch,), generator=gen)
    index = torch.randint(0, 4096, (batch,), generator=gen)
    return logits, (values, ids, temperature, greedy, seeds, index)


def test_reference_is_the_truncated_tempered_distribution():
    logits, (values, ids, temperature, greedy, seeds, index) = _case(0, 64, 100, 8)
    token, probs = draft_sample_ref(values, ids, temperature, greedy, seeds, index, STREAM)
    full = torch.softmax(logits / temperature[:, None], dim=-1)
    want = full.gather(1, ids)
    torch.testing.assert_close(probs, want / want.sum(-1, keepdim=True))
    u = counter_uniforms_ref(seeds, index, STREAM)
    for b in range(64):
        if greedy[b]:
            assert token[b] == logits[b].argmax()
        else:  # the first entry whose cumulative mass passes u
            cdf = probs[b].cumsum(0)
            assert token[b] == ids[b, min(int((cdf <= u[b] * cdf[-1]).sum()), 7)]


def test_reference_draws_tokens_in_proportion():
    """One row drawn at many indices: each of its top M tokens comes up about as often as q' says."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    values, ids = logits.topk(4, dim=-1)
    n = 20000
    token, probs = draft_sample_ref(values.expand(n, -1), ids.expand(n, -1), torch.full((n,), 0.8),
                                    torch.zeros(n, dtype=torch.bool), torch.full((n,), 7), torch.arange(n), STREAM)
    freq = torch.bincount(token, minlength=6).float() / n
    torch.testing.assert_close(freq[ids[0]], probs[0], atol=0.015, rtol=0)
    assert freq[4:].sum() == 0


@pytest.mark.parametrize("batch,vocab,m", [(1, 64, 8), (7, 100, 32), (33, 500, 5), (4, 16, 16)])
def test_kernel_matches_reference(kernels, batch, vocab, m):
    from mtpserve.kernels.draft_sample import draft_sample

    _, args = _case(batch + vocab + m, batch, vocab, m)
    want_token, want_probs = draft_sample_ref(*args, STREAM)
    token, probs = draft_sample(*(a.to(kernels.device) for a in args), STREAM)
    assert token.dtype == torch.int64 and probs.dtype == torch.float32
    torch.testing.assert_close(probs.cpu(), want_probs, atol=1e-6, rtol=1e-5)
    assert torch.equal(token.cpu(), want_token)


def test_kernel_takes_bf16_strided_values_and_rejects_bad_arguments(kernels):
    from mtpserve.kernels.draft_sample import draft_sample

    _, (values, ids, temperature, greedy, seeds, index) = _case(3, 5, 50, 8)
    dev = kernels.device
    wide = torch.cat((values, values), dim=1).to(torch.bfloat16)  # a [B, M] view with row stride 2M
    want_token, want_probs = draft_sample_ref(wide[:, :8], ids, temperature, greedy, seeds, index, STREAM)
    token, probs = draft_sample(wide.to(dev)[:, :8], *(a.to(dev) for a in (ids, temperature, greedy, seeds, index)),
                                STREAM)
    torch.testing.assert_close(probs.cpu(), want_probs, atol=1e-6, rtol=1e-5)
    assert torch.equal(token.cpu(), want_token)
    with pytest.raises(ValueError, match="temperature"):
        draft_sample(values.to(dev), ids.to(dev), temperature.double().to(dev), greedy.to(dev), seeds.to(dev),
                     index.to(dev), STREAM)
