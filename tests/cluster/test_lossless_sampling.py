"""End-to-end losslessness (docs/design.md §4): with k = 3 the first two tokens have the distribution
that sampling without speculation has, for each sampling setting.

The reference is exact, not sampled: p(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1), from
transformers' logits and the sampling transform written out here from its definition.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.workers import rejection
from tests.checkpoints import load_hf_model, make_hf_checkpoint
from tests.stats import ALPHA, chi_square_pvalue, samples_for_power

VOCAB = 6
PROMPT = [1, 4, 2]
SETTINGS = {
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.3),
    "penalties": dict(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4),
    "hot": dict(temperature=1.5),
}
SAMPLES = samples_for_power(VOCAB * VOCAB, tv=0.03)


@pytest.fixture(scope="module")
def small_vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-token model with 3 random MTP modules: peaked but not deterministic distributions,
    and proposals that differ from the target's, so drafts are accepted about 80% of the time."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("vocab6"), vocab_size=VOCAB, num_mtp=3, seed=5)


def _transform(logits: np.ndarray, prompt: list[int], output: list[int], s: dict) -> np.ndarray:
    """Penalties, temperature, top-k, top-p, min-p: the definitions, one row at a time."""
    logits = logits.astype(np.float64).copy()
    counts = np.bincount(output, minlength=VOCAB)
    seen = np.isin(np.arange(VOCAB), prompt + output)
    rep = s.get("repetition_penalty", 1.0)
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
    logits -= s.get("frequency_penalty", 0.0) * counts + s.get("presence_penalty", 0.0) * (counts > 0)
    logits /= s["temperature"]
    if "top_k" in s:
        logits[logits < np.sort(logits)[-s["top_k"]]] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if "top_p" in s:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        probs[order[before >= s["top_p"]]] = 0.0
    if "min_p" in s:
        probs[probs < s["min_p"] * probs.max()] = 0.0
    return probs / probs.sum()


def _exact_joint(path: Path, s: dict) -> np.ndarray:
    hf = load_hf_model(path)
    with torch.no_grad():
        first = _transform(hf(torch.tensor([PROMPT])).logits[0, -1].numpy(), PROMPT, [], s)
        rows = hf(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1].numpy()
    return np.stack([first[t] * _transform(rows[t], PROMPT, [t], s) for t in range(VOCAB)])


def _sampled_joint(path: Path, s: dict, seed: int) -> tuple[np.ndarray, float]:
    llm = LLM(str(path), num_speculative_tokens=3, max_num_seqs=1024, max_num_batched_tokens=8192, seed=seed)
    # max_tokens 5: the step after the prefill verifies all three drafts.
    outs = llm.generate([PROMPT] * SAMPLES, SamplingParams(max_tokens=5, ignore_eos=True, **s))
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, ([o.token_ids[0] for o in outs], [o.token_ids[1] for o in outs]), 1)
    spec = llm.engine.spec
    return counts, spec.num_accepted_tokens / max(spec.num_draft_tokens, 1)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_first_two_tokens_keep_the_target_distribution(small_vocab_ckpt: Path, name: str) -> None:
    s = SETTINGS[name]
    counts, acceptance = _sampled_joint(small_vocab_ckpt, s, seed=len(name))
    assert 0.05 < acceptance < 0.95, "drafts must be both accepted and rejected for the test to bite"
    assert chi_square_pvalue(counts, _exact_joint(small_vocab_ckpt, s)) > ALPHA


def _biased_verify(p, target_argmax, draft_ids, q_ids, q_probs, num_drafts, greedy, u_accept, u_sample):
    """Resample from p after a rejection instead of from the residual: a subtly lossy verifier."""
    tokens, accepted = rejection.__dict__["_true_verify"](p, target_argmax, draft_ids, q_ids, q_probs,
                                                          num_drafts, greedy, u_accept, u_sample)
    rows = torch.arange(p.shape[0])
    rejected = accepted < num_drafts
    p_a = p[rows, accepted]
    cdf = p_a.cumsum(-1)
    resampled = torch.searchsorted(cdf, (u_sample[rows, accepted] * cdf[:, -1])[:, None], right=True).squeeze(-1)
    tokens[rows, accepted] = torch.where(rejected, resampled.clamp(max=p.shape[-1] - 1), tokens[rows, accepted])
    return tokens, accepted


def test_the_check_rejects_a_biased_verifier(small_vocab_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(rejection.__dict__, "_true_verify", rejection.verify)
    # What both paths verify with on the CPU (verify_seeded draws the uniforms, then calls it).
    monkeypatch.setattr(rejection, "verify", _biased_verify)
    s = SETTINGS["temperature"]
    counts, _ = _sampled_joint(small_vocab_ckpt, s, seed=1)
    assert chi_square_pvalue(counts, _exact_joint(small_vocab_ckpt, s)) < ALPHA
