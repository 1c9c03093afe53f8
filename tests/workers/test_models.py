"""The target decoder over paged KV matches transformers' Llama / Qwen2 / Qwen3 logits (fp32, CPU).

Checked: a whole-prompt prefill of several requests in one flat batch with shuffled block tables;
token-by-token paged decoding across KV block boundaries against transformers on the full prefix at
every step; chunked prefill (mixed with another request's decoding) against whole prefill.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtpserve.workers.models.layers import rope_inv_freq
from mtpserve.workers.models.loader import load_model
from tests.checkpoints import load_hf_model, make_batch, make_hf_checkpoint, model_kv_pool, shuffled_block_tables

TOL = 1e-4
VOCAB = 97

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the scaled and the interpolated frequency bands both occur with head_dim 16.
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

CONFIGS = {
    "llama": dict(family="llama"),
    "llama-llama3rope-tied-bias": dict(family="llama", tie=True, attention_bias=True, rope_scaling=LLAMA3_ROPE),
    "qwen2-qkvbias": dict(family="qwen2"),
    "qwen2-tied": dict(family="qwen2", tie=True, seed=3),
    "qwen3": dict(family="qwen3", rope_theta=1e6),
    "qwen3-tied-bias": dict(family="qwen3", tie=True, attention_bias=True, seed=5),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def models(request, tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), vocab_size=VOCAB, **CONFIGS[request.param])
    hf = load_hf_model(path)
    ours = load_model(path, torch.float32, "cpu")
    return hf, ours, request.param


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _hf_last_logits(hf, seqs: list[list[int]]) -> torch.Tensor:
    """transformers' next-token logits after each full prefix, in one call: the prefixes are padded
    on the right, which causal attention keeps from influencing the real positions."""
    longest = max(map(len, seqs))
    batch = torch.tensor([s + [0] * (longest - len(s)) for s in seqs])
    with torch.no_grad():
        logits = hf(batch).logits.float()
    return logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]


def _ours(ours, ids, positions, meta, kv) -> torch.Tensor:
    with torch.no_grad():
        return ours.target.logits(ours.target(ids, positions, meta, kv))


def _pool(ours, num_blocks: int, block_size: int, seed: int = 0):
    cfg = ours.config
    return model_kv_pool(cfg, cfg.num_layers, num_blocks, block_size, seed=seed)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


def test_config_and_rope_match_transformers(models):
    hf, ours, name = models
    cfg = ours.config
    assert cfg.architecture == type(hf).__name__
    assert cfg.tie_word_embeddings == (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr())
    if cfg.tie_word_embeddings:
        assert ours.target.lm_head.weight is ours.target.embed_tokens.weight
    inv_freq = hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(rope_inv_freq(cfg.rope, cfg.head_dim), inv_freq, rtol=1e-6, atol=0)
    if "llama3rope" in name:
        assert cfg.rope.kind == "llama3"
        plain = rope_inv_freq(type(cfg.rope)(theta=cfg.rope.theta), cfg.head_dim)
        assert not torch.allclose(plain, inv_freq), "llama3 scaling changed no frequency; the test config is too weak"
    assert ours.target.logits(torch.zeros(1, cfg.hidden_size)).dtype == torch.float32


def test_flat_batch_prefill_matches_transformers(models):
    hf, ours, _ = models
    block_size = 8
    prompts = _prompts([5, 1, 13, 150, 8, 16], seed=1)
    per_req = math.ceil(max(map(len, prompts)) / block_size)
    num_blocks = len(prompts) * per_req + 5
    tables = shuffled_block_tables(len(prompts), per_req, num_blocks, seed=2)
    ids, positions, meta = make_batch([(p, 0, t) for p, t in zip(prompts, tables)], block_size)
    logits = _ours(ours, ids, positions, meta, _pool(ours, num_blocks, block_size))
    assert logits.shape == (sum(map(len, prompts)), VOCAB)
    start = 0
    for r, prompt in enumerate(prompts):
        _assert_close(logits[start:start + len(prompt)], _hf_logits(hf, prompt), f"request {r} (len {len(prompt)})")
        start += len(prompt)


def test_paged_decode_token_by_token_matches_transformers(models):
    hf, ours, _ = models
    block_size = 4
    prompts = _prompts([3, 6, 1, 9], seed=3)
    decode_steps = [14, 9, 17, 5]  # requests leave the batch at different steps
    gen = torch.Generator().manual_seed(4)
    per_req = math.ceil(max(len(p) + n for p, n in zip(prompts, decode_steps)) / block_size)
    num_blocks = len(prompts) * per_req + 3
    tables = shuffled_block_tables(len(prompts), per_req, num_blocks, seed=5)
    kv = _pool(ours, num_blocks, block_size)

    ids, positions, meta = make_batch([(p, 0, t) for p, t in zip(prompts, tables)], block_size)
    logits = _ours(ours, ids, positions, meta, kv)
    ends = meta.query_start_loc[1:].long() - 1
    seqs = [list(p) for p in prompts]
    expected = _hf_last_logits(hf, seqs)
    for r in range(len(prompts)):
        _assert_close(logits[ends[r]], expected[r], f"prefill of request {r}")

    crossed = 0
    for step in range(max(decode_steps)):
        active = [r for r in range(len(prompts)) if step < decode_steps[r]]
        new = {r: int(torch.randint(0, VOCAB, (1,), generator=gen)) for r in active}
        ids, positions, meta = make_batch([([new[r]], len(seqs[r]), tables[r]) for r in active], block_size)
        logits = _ours(ours, ids, positions, meta, kv)
        assert logits.shape == (len(active), VOCAB)
        for r in active:
            crossed += len(seqs[r]) % block_size == 0
            seqs[r].append(new[r])
        expected = _hf_last_logits(hf, [seqs[r] for r in active])
        for row, r in enumerate(active):
            _assert_close(logits[row], expected[row], f"decode step {step}, request {r}, position {len(seqs[r]) - 1}")
    assert crossed >= 8, "decoding should start new KV blocks several times"


def test_chunked_prefill_equals_whole_prefill(models):
    hf, ours, _ = models
    block_size = 8
    prompt, other = _prompts([29, 4], seed=6)
    chunks = [7, 1, 12, 9]
    per_req = math.ceil((len(prompt) + len(chunks)) / block_size)
    num_blocks = 2 * per_req + 4
    table, other_table = shuffled_block_tables(2, per_req, num_blocks, seed=7)

    # Whole prompt in one step, in its own pool.
    ids, positions, meta = make_batch([(prompt, 0, table)], block_size)
    whole = _ours(ours, ids, positions, meta, _pool(ours, num_blocks, block_size, seed=1))
    _assert_close(whole, _hf_logits(hf, prompt), "whole prefill vs transformers")

    # The same prompt in chunks; each step also carries a decode token of another request.
    kv = _pool(ours, num_blocks, block_size, seed=2)
    ids, positions, meta = make_batch([(other, 0, other_table)], block_size)
    _ours(ours, ids, positions, meta, kv)
    other_seq = list(other)
    gen = torch.Generator().manual_seed(8)
    pieces = []
    start = 0
    for n in chunks:
        tok = int(torch.randint(0, VOCAB, (1,), generator=gen))
        batch = [([tok], len(other_seq), other_table), (prompt[start:start + n], start, table)]
        ids, positions, meta = make_batch(batch, block_size)
        logits = _ours(ours, ids, positions, meta, kv)
        other_seq.append(tok)
        _assert_close(logits[0], _hf_logits(hf, other_seq)[-1], f"decode row beside chunk at {start}")
        pieces.append(logits[1:])
        start += n
    chunked = torch.cat(pieces)
    _assert_close(chunked, whole, "chunked prefill vs whole prefill")
