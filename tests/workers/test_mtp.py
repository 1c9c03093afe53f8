"""MTP modules (docs/design.md §3) against an independent teacher-forced reference, both layouts.

The reference below is plain torch written from the docs/design.md §3 formula: its own RMSNorm, RoPE,
causal GQA attention and SwiGLU, with every weight read straight from model.safetensors by its
checkpoint name. It does not use mtpserve's layers, config parsing or weight-name maps; the wiring
flags (which target hidden, concat order, what the next module receives, position-0 masking) are
stated per case here, not read from mtpserve's MTPConfig.

Teacher forcing over tokens t_0 .. t_{S-1}: module 0 gets (h_i, t_{i+1}); module k gets
(g^{k-1}_i, t_{i+k+1}) for i = 0 .. S-2-k (positions whose token is beyond the sequence are dropped);
logits^k = Head_k(norm_k(g^k_i)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from mtpserve.workers.models.loader import load_model
from tests.checkpoints import load_hf_model, make_batch, make_hf_checkpoint, make_kv_pool, model_kv_pool, shuffled_block_tables
from tests.reference import DEEPSEEK, MIMO, Reference, Wiring

TOL = 1e-4
VOCAB = 97


# ------------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    family: str
    wiring: Wiring
    num: int
    tie: bool = False
    own_head: bool = False
    own_embed: bool = False
    config_extra: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


CASES = {
    "deepseek-qwen3-3mod": Case("qwen3", DEEPSEEK, 3),
    "deepseek-llama-tied-ownhead-ownembed": Case("llama", DEEPSEEK, 2, tie=True, own_head=True, own_embed=True, seed=1),
    "deepseek-qwen3-ownembed": Case("qwen3", DEEPSEEK, 2, own_embed=True, seed=2),
    "mimo-qwen2-3mod": Case("qwen2", MIMO, 3, seed=3),
    "mimo-qwen3-tied": Case("qwen3", MIMO, 2, tie=True, seed=4),
    # Explicit config switches override the layout defaults.
    "deepseek-qwen2-prenorm-passnormed-nomask": Case(
        "qwen2",
        Wiring("deepseek", hidden_pre_norm=True, hidden_first=False, pass_normed=True, mask_position0=False),
        2,
        config_extra={"mtp_hidden_pre_norm": True, "mtp_pass_normed": True, "mtp_mask_position0": False},
        seed=5,
    ),
    "mimo-qwen2-embfirst-postnorm": Case(
        "qwen2",
        Wiring("mimo", hidden_pre_norm=False, hidden_first=False, pass_normed=True),
        2,
        config_extra={"mtp_hidden_first": False, "mtp_hidden_pre_norm": False},
        seed=6,
    ),
}


COPY_CASES = [name for name, c in CASES.items() if c.own_head or c.own_embed]
_BUILT: dict[str, tuple] = {}


def _build(name: str, tmp_path_factory) -> tuple:
    if name in _BUILT:
        return _BUILT[name]
    c = CASES[name]
    path = make_hf_checkpoint(
        tmp_path_factory.mktemp(name),
        family=c.family,
        num_mtp=c.num,
        mtp_layout=c.wiring.layout,
        vocab_size=VOCAB,
        tie=c.tie,
        seed=c.seed,
        mtp_own_head=c.own_head,
        mtp_own_embed=c.own_embed,
        config_extra=c.config_extra,
    )
    _BUILT[name] = (c, path, Reference(path), load_model(path, torch.float32, "cpu"))
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _sequences(lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


def _target_hidden(loaded, seqs: list[torch.Tensor], block_size: int, seed: int) -> list[torch.Tensor]:
    """mtpserve's target over the sequences (one flat batch), as the hidden MTP module 0 receives."""
    cfg = loaded.config
    per_req = math.ceil(max(len(s) for s in seqs) / block_size)
    num_blocks = len(seqs) * per_req + 2
    tables = shuffled_block_tables(len(seqs), per_req, num_blocks, seed=seed)
    ids, positions, meta = make_batch([(s.tolist(), 0, t) for s, t in zip(seqs, tables)], block_size)
    kv = model_kv_pool(cfg, cfg.num_layers, num_blocks, block_size, seed=seed)
    hidden = loaded.target(ids, positions, meta, kv)
    if not cfg.mtp.hidden_pre_norm:
        hidden = loaded.target.norm(hidden)
    return list(hidden.split([len(s) for s in seqs]))


def test_reference_target_matches_transformers(case):
    """The plain-torch reference is itself right: its target logits equal transformers'."""
    c, path, ref, _ = case
    hf = load_hf_model(path)
    tokens = _sequences([23], seed=10)[0]
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    _assert_close(ref.target(tokens)[2], expected, "reference target logits")


@torch.no_grad()
def test_mtp_flat_batch_matches_teacher_forced_reference(case):
    c, _, ref, loaded = case
    cfg, stack, target = loaded.config, loaded.mtp, loaded.target
    assert len(stack) == c.num
    assert cfg.mtp.layout == c.wiring.layout
    block_size = 4
    seqs = _sequences([19, 11, 6], seed=11)
    prev = _target_hidden(loaded, seqs, block_size, seed=12)
    refs = [ref.mtp(s, c.num, c.wiring) for s in seqs]
    for k in range(c.num):
        lens = [len(s) - 1 - k for s in seqs]
        per_req = math.ceil(max(lens) / block_size)
        num_blocks = len(seqs) * per_req + 3
        tables = shuffled_block_tables(len(seqs), per_req, num_blocks, seed=20 + k)
        batch = [(s[k + 1:].tolist(), 0, t) for s, t in zip(seqs, tables)]
        ids, positions, meta = make_batch(batch, block_size)
        (kv,) = model_kv_pool(cfg, 1, num_blocks, block_size, seed=30 + k)
        prev_rows = torch.cat([p[:n] for p, n in zip(prev, lens)])
        g = stack(k, ids, prev_rows, positions, meta, kv, target.embed_tokens)
        logits = stack.logits(k, g, target.lm_head)
        assert logits.dtype == torch.float32
        for r, rows in enumerate(logits.split(lens)):
            _assert_close(rows, refs[r][k], f"module {k}, request {r}")
        prev = list(stack.next_hidden(k, g).split(lens))


@torch.no_grad()
def test_mtp_incremental_steps_match_reference(case):
    """Each module run step by step over its paged KV (a prefill chunk, then 1-3 positions a step)."""
    c, _, ref, loaded = case
    cfg, stack, target = loaded.config, loaded.mtp, loaded.target
    block_size = 4
    (seq,) = _sequences([17], seed=13)
    prev = _target_hidden(loaded, [seq], block_size, seed=14)[0]
    expected = ref.mtp(seq, c.num, c.wiring)
    for k in range(c.num):
        n = len(seq) - 1 - k
        per_req = math.ceil(n / block_size)
        num_blocks = per_req + 4
        (table,) = shuffled_block_tables(1, per_req, num_blocks, seed=40 + k)
        (kv,) = model_kv_pool(cfg, 1, num_blocks, block_size, seed=50 + k)
        tokens = seq[k + 1:].tolist()
        gs, start = [], 0
        for size in [5, 1, 1, 3, 2, 1, 100]:
            size = min(size, n - start)
            if size <= 0:
                break
            ids, positions, meta = make_batch([(tokens[start:start + size], start, table)], block_size)
            gs.append(stack(k, ids, prev[start:start + size], positions, meta, kv, target.embed_tokens))
            start += size
        g = torch.cat(gs)
        _assert_close(stack.logits(k, g, target.lm_head), expected[k], f"module {k} stepped")
        prev = stack.next_hidden(k, g)


@pytest.mark.parametrize("name", COPY_CASES)
@torch.no_grad()
def test_per_module_head_and_embedding_are_used(name, tmp_path_factory):
    c, _, ref, loaded = _build(name, tmp_path_factory)
    for module in loaded.mtp.mtp:
        assert (module.head is not None) == c.own_head
        assert (module.embed_tokens is not None) == c.own_embed
    (seq,) = _sequences([15], seed=15)
    with_copies = ref.mtp(seq, c.num, c.wiring, use_own_copies=True)
    shared_only = ref.mtp(seq, c.num, c.wiring, use_own_copies=False)
    # The copies make a real difference, so matching the reference (the tests above) means they are used.
    for k in range(c.num):
        assert (with_copies[k] - shared_only[k]).abs().max() > 0.1
    block_size = 8
    prev = _target_hidden(loaded, [seq], block_size, seed=16)[0]
    cfg = loaded.config
    for k in range(c.num):
        n = len(seq) - 1 - k
        (table,) = shuffled_block_tables(1, math.ceil(n / block_size), 4, seed=k)
        (kv,) = make_kv_pool(1, 4, block_size, cfg.num_kv_heads, cfg.head_dim)
        ids, positions, meta = make_batch([(seq[k + 1:].tolist(), 0, table)], block_size)
        g = loaded.mtp(k, ids, prev[:n], positions, meta, kv, loaded.target.embed_tokens)
        _assert_close(loaded.mtp.logits(k, g, loaded.target.lm_head), with_copies[k], f"module {k} with copies")
        prev = loaded.mtp.next_hidden(k, g)
