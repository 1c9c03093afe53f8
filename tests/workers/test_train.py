"""The training core and the default-model training script (CPU, tiny settings)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from mtpserve.workers.attention import AttentionMetadata, LayerKV
from mtpserve.workers.models import train as T
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.loader import LoadedModel, load_model
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.models.writer import save_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "train_default_model.py"
VOCAB = 64

SNIPPET = 'def f(xs: list[int]) -> int:\n    """Sum.\"""\n\treturn sum(x * 2 for x in xs)  # ünïcode ✓\n'


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- (a) the CLI, tiny


def test_tiny_cli_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    proc = subprocess.run(  # the timeout only guards against a hang: timings belong in benchmarks/
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--device", "cpu"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for head in ("main", "mtp0", "mtp1", "mtp2"):
        assert f"{head}=" in proc.stdout  # loss logged per module

    loaded = load_model(out, torch.float32, "cpu")
    assert loaded.config.mtp.num_modules == 3 and len(loaded.mtp) == 3
    assert loaded.config.architecture == "Qwen3ForCausalLM"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.decode(tok.encode(SNIPPET).ids) == SNIPPET
    eot = tok.token_to_id("<|endoftext|>")
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 3 and config["eos_token_id"] == eot
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eot
    facts = json.loads((out / "training_facts.json").read_text())
    assert facts["steps"] > 0 and facts["tokens_seen"] > 0 and facts["seed"] == 0
    assert set(facts["heldout_top1"]) == set(facts["final_train_loss"]) == {"main", "mtp0", "mtp1", "mtp2"}
    assert facts["device"].startswith("cpu") and facts["torch"] == torch.__version__


def test_default_model_fits_the_package_budget() -> None:
    script = _load_script()
    config = script.model_config(8192, 0, tiny=False)
    assert config["num_nextn_predict_layers"] == 3 and config["tie_word_embeddings"]
    assert script.checkpoint_bytes(config) <= 24_000_000


def test_heldout_split_is_stable_and_about_five_percent() -> None:
    script = _load_script()
    names = [f"pkg{i // 50}/mod{i}.py" for i in range(4000)]
    splits = [script.split_of(n) for n in names]
    assert splits == [script.split_of(n) for n in names]
    held = sum(s != "train" for s in splits) / len(splits)
    assert 0.035 < held < 0.065
    assert {"val", "test"} <= set(splits)


# --------------------------------------------------------------------------- (b) MTP heads learn


@pytest.fixture(scope="module")
def synthetic() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = T.synthetic_tokens(VOCAB, 12_000, seed=1, noise=0.1)
    return tokens[:10_000], tokens[10_000:]


@pytest.fixture(scope="module")
def trained(synthetic: tuple[torch.Tensor, torch.Tensor]) -> tuple[TargetModel, MTPStack]:
    return T.train_tiny(synthetic[0], T.tiny_config(VOCAB), steps=60, seed=0, seq_len=32, lr=1e-2)


def test_train_tiny_every_mtp_module_beats_chance(
    trained: tuple[TargetModel, MTPStack], synthetic: tuple[torch.Tensor, torch.Tensor]
) -> None:
    target, mtp = trained
    metrics = T.evaluate(target, mtp, synthetic[1], seq_len=64)
    top1 = metrics["top1"]
    assert len(top1) == 4
    # Chance is 1/64; the stream's ceiling is about 0.9 for every head.
    assert all(acc > 0.5 for acc in top1), top1


def test_mtp_objective_weights_the_mean_of_the_modules() -> None:
    tokens = torch.randint(0, 8, (2, 6))
    logits = [torch.randn(2, 6, 8) for _ in range(4)]
    loss, ces = T.mtp_objective(logits, tokens, 0.3)
    assert torch.allclose(loss, ces[0] + 0.3 * ces[1:].mean())
    # Module k (head k+1) at position i is scored against t_{i+k+2}; the last k+2 positions have none.
    last_head = T.head_targets(tokens, 3)
    assert torch.equal(last_head[:, :2], tokens[:, 4:]) and (last_head[:, 2:] == T.IGNORE).all()


# --------------------------------------------------------------------------- (c) dense == paged


def _meta(batch: int, seq: int, block_size: int) -> AttentionMetadata:
    blocks = -(-seq // block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    pos = torch.arange(seq)
    slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * seq,
        seq_lens=torch.full((batch,), seq, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=seq,
        max_seq_len=seq,
    )


def _pool(loaded: LoadedModel, batch: int, seq: int, block_size: int) -> LayerKV:
    cfg = loaded.config
    shape = (batch * -(-seq // block_size), block_size, cfg.num_kv_heads, cfg.head_dim)
    return LayerKV(torch.zeros(shape), torch.zeros(shape))


@torch.no_grad()
def _paged_logits(loaded: LoadedModel, tokens: torch.Tensor, block_size: int = 8) -> list[torch.Tensor]:
    """Serving path: target prefill, then each module teacher-forced over the positions it has inputs for."""
    batch, seq = tokens.shape
    target, mtp, cfg = loaded.target, loaded.mtp, loaded.config
    positions = torch.arange(seq).repeat(batch)
    kv = [_pool(loaded, batch, seq, block_size) for _ in range(cfg.num_layers)]
    hidden = target(tokens.flatten(), positions, _meta(batch, seq, block_size), kv)
    out = [target.logits(hidden).view(batch, seq, -1)]
    prev = (hidden if cfg.mtp.hidden_pre_norm else target.norm(hidden)).view(batch, seq, -1)
    for k in range(len(mtp)):
        n = seq - k - 1  # module k at position i consumes t_{i+k+1}
        g = mtp(
            k, tokens[:, k + 1 :].flatten(), prev[:, :n].flatten(0, 1), torch.arange(n).repeat(batch),
            _meta(batch, n, block_size), _pool(loaded, batch, n, block_size), target.embed_tokens,
        )
        out.append(mtp.logits(k, g, target.lm_head).view(batch, n, -1))
        prev = mtp.next_hidden(k, g).view(batch, n, -1)
    return out


def _assert_dense_matches_paged(
    target: TargetModel, mtp: MTPStack, hf_config: dict[str, Any], tokens: torch.Tensor, tmp_path: Path
) -> None:
    save_checkpoint(tmp_path, hf_config, target, mtp, dtype=torch.float32)
    loaded = load_model(tmp_path, torch.float32, "cpu")
    with torch.no_grad():
        dense = T.dense_forward(target, mtp, tokens)
    paged = _paged_logits(loaded, tokens)
    assert len(dense) == len(paged) == 1 + hf_config["num_nextn_predict_layers"]
    for head, (d, p) in enumerate(zip(dense, paged)):
        assert p.abs().max() > 1.0  # the comparison is not between near-zero logits
        torch.testing.assert_close(d[:, : p.shape[1]], p, atol=1e-4, rtol=1e-4, msg=lambda m: f"head {head}: {m}")


def test_dense_training_forward_matches_paged_serving(
    trained: tuple[TargetModel, MTPStack], synthetic: tuple[torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    target, mtp = trained
    tokens = synthetic[1][:60].view(3, 20)
    _assert_dense_matches_paged(target, mtp, T.tiny_config(VOCAB), tokens, tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        {"mtp_hidden_first": True, "mtp_hidden_pre_norm": True, "mtp_pass_normed": True, "mtp_mask_position0": False},
        {"architectures": ["MiMoForCausalLM"], "model_type": "mimo"},
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_nextn_predict_layers": 2},
    ],
    ids=["qwen3-other-wiring", "mimo", "llama"],
)
def test_dense_matches_paged_for_other_wirings(overrides: dict[str, Any], tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_config = T.tiny_config(VOCAB) | overrides
    _, target, mtp = T.build_models(hf_config)
    T.init_weights(target, mtp, std=0.3)  # untrained weights large enough to give non-trivial logits
    for p in list(target.parameters()) + list(mtp.parameters()):
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)  # norms (and biases) away from their identity/zero init
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    _assert_dense_matches_paged(target, mtp, hf_config, tokens, tmp_path)
