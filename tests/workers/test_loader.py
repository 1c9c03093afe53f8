"""Checkpoint loading: every error names what is wrong, sharded == single file, writer round trip,
and a failing load reads no tensor data and builds no model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mtpserve.errors import CheckpointError
from mtpserve.workers.models import loader as loader_mod
from mtpserve.workers.models.loader import load_model
from mtpserve.workers.models.writer import save_checkpoint
from tests.checkpoints import (
    make_batch,
    make_hf_checkpoint,
    make_kv_pool,
    read_config,
    read_tensors,
    write_config,
    write_tensors,
)

VOCAB = 97


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints built once; tests copy them before breaking them."""
    root = tmp_path_factory.mktemp("pristine")
    return {
        "deepseek": make_hf_checkpoint(root / "deepseek", "qwen3", num_mtp=2, vocab_size=VOCAB),
        "mimo": make_hf_checkpoint(root / "mimo", "qwen2", num_mtp=2, mtp_layout="mimo", vocab_size=VOCAB, seed=1),
        "tied-copies": make_hf_checkpoint(
            root / "tied-copies", "llama", num_mtp=2, vocab_size=VOCAB, tie=True, seed=2,
            mtp_own_head=True, mtp_own_embed=True,
        ),
    }


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of a pristine checkpoint: ckpt("deepseek") -> Path."""

    def copy(name: str = "deepseek") -> Path:
        dst = tmp_path / name
        shutil.copytree(pristine[name], dst)
        return dst

    return copy


class _Counting:
    """Wraps loader.safe_open / TargetModel to count tensor reads and model constructions."""

    def __init__(self, monkeypatch) -> None:
        self.get_tensor = 0
        self.models = 0
        real_open, real_target = loader_mod.safe_open, loader_mod.TargetModel
        counter = self

        class Handle:
            def __init__(self, inner) -> None:
                self.inner = inner

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return self.f.get_slice(name)

            def get_tensor(self, name):
                counter.get_tensor += 1
                return self.f.get_tensor(name)

        def target(*args, **kwargs):
            counter.models += 1
            return real_target(*args, **kwargs)

        monkeypatch.setattr(loader_mod, "safe_open", lambda *a, **kw: Handle(real_open(*a, **kw)))
        monkeypatch.setattr(loader_mod, "TargetModel", target)


def _edit_tensors(path: Path, fn) -> None:
    tensors = read_tensors(path)
    fn(tensors)
    write_tensors(path / "model.safetensors", tensors)


def _edit_config(path: Path, fn) -> None:
    raw = read_config(path)
    fn(raw)
    write_config(path, raw)


def _load_fails(path: Path, monkeypatch, *fragments: str) -> str:
    """load_model raises CheckpointError naming every fragment, having read no tensor and built no model."""
    counting = _Counting(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_model(path, torch.float32, "cpu")
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in error message {msg!r}"
    assert counting.get_tensor == 0, "a failing load read tensor data"
    assert counting.models == 0, "a failing load built a model"
    return msg


def _shard(src: Path, dst: Path, num_shards: int = 3) -> None:
    """Rewrite src's single-file checkpoint as num_shards files plus model.safetensors.index.json."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = read_tensors(src)
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        write_tensors(dst / file, part)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


@torch.no_grad()
def _all_logits(loaded, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Target logits and every MTP module's logits over one sequence (module 0 fed the target hidden)."""
    cfg, block_size = loaded.config, 8
    n = len(tokens)
    table = list(range((n + block_size - 1) // block_size))
    ids, pos, meta = make_batch([(tokens.tolist(), 0, table)], block_size)
    kv = make_kv_pool(cfg.num_layers, len(table), block_size, cfg.num_kv_heads, cfg.head_dim)
    hidden = loaded.target(ids, pos, meta, kv)
    out = [loaded.target.logits(hidden)]
    prev = hidden if cfg.mtp.hidden_pre_norm else loaded.target.norm(hidden)
    for k in range(len(loaded.mtp)):
        m = n - 1 - k
        ids, pos, meta = make_batch([(tokens[k + 1:].tolist(), 0, table)], block_size)
        (mkv,) = make_kv_pool(1, len(table), block_size, cfg.num_kv_heads, cfg.head_dim)
        g = loaded.mtp(k, ids, prev[:m], pos, meta, mkv, loaded.target.embed_tokens)
        out.append(loaded.mtp.logits(k, g, loaded.target.lm_head))
        prev = loaded.mtp.next_hidden(k, g)
    return out


def _state(loaded) -> dict[str, torch.Tensor]:
    return {f"target.{n}": p for n, p in loaded.target.named_parameters()} | {
        f"mtp.{n}": p for n, p in loaded.mtp.named_parameters()
    }


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "name, tensor, shape",
    [
        ("deepseek", "model.layers.1.self_attn.k_proj.weight", "[32, 64]"),
        ("deepseek", "lm_head.weight", "[97, 64]"),
        ("deepseek", "model.layers.0.self_attn.q_norm.weight", "[16]"),
        ("deepseek", "model.layers.3.eh_proj.weight", "[64, 128]"),
        ("deepseek", "model.layers.2.mlp.gate_proj.weight", "[96, 64]"),
        ("mimo", "model.layers.0.self_attn.v_proj.bias", "[32]"),
        ("mimo", "model.mtp_layers.1.final_layernorm.weight", "[64]"),
        ("mimo", "model.mtp_layers.0.input_proj.weight", "[64, 128]"),
    ],
)
def test_missing_tensor_is_named_with_expected_shape(ckpt, monkeypatch, name, tensor, shape):
    path = ckpt(name)
    _edit_tensors(path, lambda t: t.pop(tensor))
    _load_fails(path, monkeypatch, f"missing tensor {tensor}", f"expected shape {shape}")


@pytest.mark.parametrize(
    "name, tensor",
    [
        ("deepseek", "model.layers.0.self_attn.extra_proj.weight"),
        ("deepseek", "model.layers.4.enorm.weight"),  # one MTP module more than the config says
        ("mimo", "model.mtp_layers.2.token_layernorm.weight"),
        ("mimo", "model.layers.0.self_attn.o_proj.bias"),  # Qwen2 has no o_proj bias
    ],
)
def test_extra_tensor_is_named(ckpt, monkeypatch, name, tensor):
    path = ckpt(name)
    _edit_tensors(path, lambda t: t.__setitem__(tensor, torch.zeros(64)))
    _load_fails(path, monkeypatch, f"unexpected tensor {tensor}")


def test_mtp_tensors_without_mtp_config_are_extra(ckpt, monkeypatch):
    path = ckpt("deepseek")
    _edit_config(path, lambda raw: raw.pop("num_nextn_predict_layers"))
    _load_fails(path, monkeypatch, "unexpected tensor model.layers.2.")


@pytest.mark.parametrize(
    "name, tensor, bad, expected",
    [
        ("deepseek", "model.layers.0.mlp.up_proj.weight", (95, 64), "[96, 64]"),
        ("deepseek", "model.embed_tokens.weight", (98, 64), "[97, 64]"),
        ("deepseek", "model.layers.3.hnorm.weight", (64, 1), "[64]"),
        ("mimo", "model.mtp_layers.0.self_attn.q_proj.bias", (48,), "[64]"),
    ],
)
def test_misshaped_tensor_is_named_with_both_shapes(ckpt, monkeypatch, name, tensor, bad, expected):
    path = ckpt(name)
    _edit_tensors(path, lambda t: t.__setitem__(tensor, torch.zeros(bad)))
    _load_fails(path, monkeypatch, f"tensor {tensor} has shape {list(bad)}", f"expected {expected}")


def test_several_problems_are_all_reported(ckpt, monkeypatch):
    path = ckpt("deepseek")

    def break_(t):
        t.pop("model.norm.weight")
        t["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 95)
        t["bogus.weight"] = torch.zeros(3)

    _edit_tensors(path, break_)
    _load_fails(path, monkeypatch, "missing tensor model.norm.weight", "model.layers.1.mlp.down_proj.weight", "bogus.weight")


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], ["MistralForCausalLM", "FalconForCausalLM"]])
def test_unknown_architecture_names_the_field(ckpt, monkeypatch, archs):
    path = ckpt()
    _edit_config(path, lambda raw: raw.__setitem__("architectures", archs))
    _load_fails(path, monkeypatch, "'architectures'", archs[0])


def test_missing_architectures_names_the_field(ckpt, monkeypatch):
    path = ckpt()
    _edit_config(path, lambda raw: raw.pop("architectures"))
    _load_fails(path, monkeypatch, "'architectures'")


@pytest.mark.parametrize(
    "key", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
)
def test_missing_config_key_is_named(ckpt, monkeypatch, key):
    path = ckpt()
    _edit_config(path, lambda raw: raw.pop(key))
    _load_fails(path, monkeypatch, f"'{key}'")


@pytest.mark.parametrize(
    "rope, fragments",
    [
        ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, ["'rope_scaling'", "yarn"]),
        ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}, ["'rope_scaling'", "low_freq_factor"]),
    ],
)
def test_unsupported_or_incomplete_rope_is_named(ckpt, monkeypatch, rope, fragments):
    path = ckpt()
    _edit_config(path, lambda raw: raw.__setitem__("rope_parameters", rope))
    _load_fails(path, monkeypatch, *fragments)


def test_mlp_bias_is_refused_by_name(ckpt, monkeypatch):
    path = ckpt()
    _edit_config(path, lambda raw: raw.__setitem__("mlp_bias", True))
    _load_fails(path, monkeypatch, "'mlp_bias'")


def test_missing_config_json(ckpt, monkeypatch):
    path = ckpt()
    (path / "config.json").unlink()
    _load_fails(path, monkeypatch, "config.json", str(path))


def test_no_safetensors(ckpt, monkeypatch):
    path = ckpt()
    (path / "model.safetensors").unlink()
    _load_fails(path, monkeypatch, "safetensors", str(path))


def test_path_not_a_directory(tmp_path, monkeypatch):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    _load_fails(file, monkeypatch, "not a directory", str(file))
    _load_fails(tmp_path / "nowhere", monkeypatch, "not a directory", "nowhere")


def test_index_naming_a_missing_shard(ckpt, tmp_path, monkeypatch):
    sharded = tmp_path / "sharded"
    _shard(ckpt(), sharded)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    _load_fails(sharded, monkeypatch, "model-00002-of-00003.safetensors")


def test_misshaped_tensor_in_a_later_shard_reads_nothing(ckpt, tmp_path, monkeypatch):
    """The check covers every shard before any data is copied: nothing is half-loaded."""
    sharded = tmp_path / "sharded"
    _shard(ckpt(), sharded, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    last = "model-00003-of-00003.safetensors"
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == last and n.endswith("norm.weight"))
    tensors = read_tensors(sharded / last)
    tensors[name] = torch.zeros(63)
    write_tensors(sharded / last, tensors)
    _load_fails(sharded, monkeypatch, f"tensor {name} has shape [63], expected [")


# ------------------------------------------------------------------------------------------------
# Successful loads


def test_good_load_reads_every_tensor_once(ckpt, monkeypatch):
    path = ckpt("tied-copies")
    counting = _Counting(monkeypatch)
    loaded = load_model(path, torch.float32, "cpu")
    assert counting.get_tensor == len(read_tensors(path)) > 0
    assert counting.models == 1
    assert loaded.target.lm_head.weight is loaded.target.embed_tokens.weight
    assert all(m.head is not None and m.embed_tokens is not None for m in loaded.mtp.mtp)


def test_tensors_land_in_the_fused_parameters(ckpt):
    path = ckpt("deepseek")
    t = read_tensors(path)
    loaded = load_model(path, torch.float32, "cpu")
    q, kv = 64, 32
    qkv = loaded.target.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[:q], t["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q:q + kv], t["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(qkv[q + kv:], t["model.layers.1.self_attn.v_proj.weight"])
    gate_up = loaded.mtp.mtp[1].block.mlp.gate_up_proj.weight
    assert torch.equal(gate_up[:96], t["model.layers.3.mlp.gate_proj.weight"])
    assert torch.equal(gate_up[96:], t["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(loaded.mtp.mtp[0].eh_proj.weight, t["model.layers.2.eh_proj.weight"])
    assert torch.equal(loaded.mtp.mtp[0].norm.weight, t["model.layers.2.shared_head.norm.weight"])


def test_ignored_and_tolerated_tensors(ckpt):
    """rotary_emb.inv_freq buffers and a redundant lm_head in a tied checkpoint do not fail the load."""
    path = ckpt("tied-copies")

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _edit_tensors(path, add)
    loaded = load_model(path, torch.float32, "cpu")
    assert loaded.target.lm_head.weight is loaded.target.embed_tokens.weight


def test_load_in_bfloat16(ckpt):
    loaded = load_model(ckpt("mimo"), torch.bfloat16, "cpu")
    assert {p.dtype for p in _state(loaded).values()} == {torch.bfloat16}
    tokens = torch.arange(3, 15)
    logits = _all_logits(loaded, tokens)
    assert all(x.dtype == torch.float32 and torch.isfinite(x).all() for x in logits)


def test_mimo_architecture_name_selects_the_mimo_layout(ckpt, tmp_path):
    """A real MiMo config says architectures ["MiMoForCausalLM"] instead of our "mtp_layout" key."""
    ours = ckpt("mimo")
    real = tmp_path / "mimo-real"
    shutil.copytree(ours, real)

    def as_mimo(raw):
        raw.pop("mtp_layout")
        raw["architectures"] = ["MiMoForCausalLM"]

    _edit_config(real, as_mimo)
    a, b = load_model(ours, torch.float32, "cpu"), load_model(real, torch.float32, "cpu")
    assert b.config.mtp == a.config.mtp and b.config.mtp.layout == "mimo"
    tokens = torch.arange(3, 20)
    for x, y in zip(_all_logits(a, tokens), _all_logits(b, tokens)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["deepseek", "mimo", "tied-copies"])
def test_sharded_checkpoint_equals_single_file(ckpt, tmp_path, name):
    single = ckpt(name)
    sharded = tmp_path / f"{name}-sharded"
    _shard(single, sharded)
    a = load_model(single, torch.float32, "cpu")
    b = load_model(sharded, torch.float32, "cpu")
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    tokens = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(0))
    la, lb = _all_logits(a, tokens), _all_logits(b, tokens)
    assert len(la) == 1 + len(a.mtp) == 3
    for x, y in zip(la, lb):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["deepseek", "mimo", "tied-copies"])
def test_writer_round_trip(ckpt, tmp_path, name):
    src = ckpt(name)
    loaded = load_model(src, torch.float32, "cpu")
    out = tmp_path / f"{name}-written"
    save_checkpoint(out, read_config(src), loaded.target, loaded.mtp, dtype=torch.float32)
    # The written file holds exactly the original tensors under the original names.
    original, written = read_tensors(src), read_tensors(out)
    assert original.keys() == written.keys()
    for key in original:
        assert torch.equal(original[key], written[key]), key
    again = load_model(out, torch.float32, "cpu")
    s1, s2 = _state(loaded), _state(again)
    assert s1.keys() == s2.keys()
    for key in s1:
        assert torch.equal(s1[key], s2[key]), key
    tokens = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(1))
    for x, y in zip(_all_logits(loaded, tokens), _all_logits(again, tokens)):
        assert torch.equal(x, y)
