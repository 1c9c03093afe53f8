"""MTP modules (DESIGN.md §3) against an independent teacher-forced reference, both layouts.

The reference below is plain torch written from the DESIGN.md §3 formula: its own RMSNorm, RoPE,
causal GQA attention and SwiGLU, with every weight read straight from model.safetensors by its
checkpoint name. It does not use mtpserve's layers, config parsing or weight-name maps; the wiring
flags (which target hidden, concat order, what the next module receives, position-0 masking) are
stated per case here, not read from mtpserve's MTPConfig.

Teacher forcing over tokens t_0 .. t_{S-1}: module 0 gets (h_i, t_{i+1}); module k gets
(g^{k-1}_i, t_{i+k+1}) for i = 0 .. S-2-k (positions whose token is beyond the sequence are dropped);
logits^k = Head_k(norm_k(g^k_i)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mtpserve.workers.models.loader import load_model
from tests.checkpoints import load_hf_model, make_batch, make_hf_checkpoint, make_kv_pool, shuffled_block_tables

TOL = 1e-4
VOCAB = 97


# ------------------------------------------------------------------------------------------------
# Independent reference


@dataclass(frozen=True)
class Wiring:
    layout: str  # "deepseek" or "mimo"
    hidden_pre_norm: bool  # module 0 gets the target hidden before the final norm
    hidden_first: bool  # eh_proj input is cat(hidden, emb) instead of cat(emb, hidden)
    pass_normed: bool  # module k+1 gets norm_k(g^k) instead of g^k
    mask_position0: bool = True


DEEPSEEK = Wiring("deepseek", hidden_pre_norm=False, hidden_first=False, pass_normed=False)
MIMO = Wiring("mimo", hidden_pre_norm=True, hidden_first=True, pass_normed=True)


class Reference:
    def __init__(self, path: Path) -> None:
        self.w = load_file(str(path / "model.safetensors"))
        raw = json.loads((path / "config.json").read_text())
        self.eps = raw["rms_norm_eps"]
        self.heads = raw["num_attention_heads"]
        self.kv_heads = raw["num_key_value_heads"]
        self.head_dim = raw["head_dim"]
        self.layers = raw["num_hidden_layers"]
        rope = raw.get("rope_parameters") or {}
        assert rope.get("rope_type", "default") == "default"
        self.theta = rope.get("rope_theta", raw.get("rope_theta"))
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w["lm_head.weight"] if "lm_head.weight" in self.w else self.embed  # tied

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = positions.float()[:, None] * inv_freq[None, :]  # [S, D/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return out if bias is None else out + bias

    def block(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """One decoder block (HF names under prefix p) over a whole sequence at positions 0..S-1."""
        s, d = x.shape[0], self.head_dim
        positions = torch.arange(s)
        h = self.rms(x, self.w[p + "input_layernorm.weight"])
        q = self.linear(h, p + "self_attn.q_proj").view(s, self.heads, d)
        k = self.linear(h, p + "self_attn.k_proj").view(s, self.kv_heads, d)
        v = self.linear(h, p + "self_attn.v_proj").view(s, self.kv_heads, d)
        if p + "self_attn.q_norm.weight" in self.w:
            q = self.rms(q, self.w[p + "self_attn.q_norm.weight"])
            k = self.rms(k, self.w[p + "self_attn.k_norm.weight"])
        q, k = self.rope(q, positions), self.rope(k, positions)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(s, self.heads * d)
        x = x + self.linear(attn, p + "self_attn.o_proj")
        h = self.rms(x, self.w[p + "post_attention_layernorm.weight"])
        mlp = F.silu(self.linear(h, p + "mlp.gate_proj")) * self.linear(h, p + "mlp.up_proj")
        return x + self.linear(mlp, p + "mlp.down_proj")

    def target(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (pre-norm hidden, post-norm hidden, logits) over the sequence."""
        x = self.embed[tokens]
        for i in range(self.layers):
            x = self.block(f"model.layers.{i}.", x)
        post = self.rms(x, self.w["model.norm.weight"])
        return x, post, post @ self.head.T

    def mtp(self, tokens: torch.Tensor, num: int, wiring: Wiring, use_own_copies: bool = True) -> list[torch.Tensor]:
        """Teacher-forced logits of modules 0..num-1; module k's rows are positions 0..S-2-k."""
        pre, post, _ = self.target(tokens)
        prev = pre if wiring.hidden_pre_norm else post
        out = []
        for k in range(num):
            if wiring.layout == "deepseek":
                p = f"model.layers.{self.layers + k}."
                enorm, hnorm, proj, norm = "enorm", "hnorm", "eh_proj", "shared_head.norm"
            else:
                p = f"model.mtp_layers.{k}."
                enorm, hnorm, proj, norm = "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"
            n = tokens.shape[0] - 1 - k
            embed = self.w.get(p + "embed_tokens.weight", self.embed) if use_own_copies else self.embed
            head = self.w.get(p + "shared_head.head.weight", self.head) if use_own_copies else self.head
            emb = embed[tokens[k + 1:k + 1 + n]].clone()
            if wiring.mask_position0:
                emb[0] = 0.0
            e = self.rms(emb, self.w[p + enorm + ".weight"])
            h = self.rms(prev[:n], self.w[p + hnorm + ".weight"])
            x = torch.cat((h, e) if wiring.hidden_first else (e, h), dim=-1) @ self.w[p + proj + ".weight"].T
            g = self.block(p, x)
            normed = self.rms(g, self.w[p + norm + ".weight"])
            out.append(normed @ head.T)
            prev = normed if wiring.pass_normed else g
        return out


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
    kv = make_kv_pool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, seed=seed)
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
        (kv,) = make_kv_pool(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, seed=30 + k)
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
        (kv,) = make_kv_pool(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, seed=50 + k)
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
