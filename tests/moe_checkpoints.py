"""Tiny GLM-4.5-style (Glm4MoeForCausalLM) and DeepSeek-V3-style (DeepseekV3ForCausalLM) checkpoints for
tests, built with transformers itself.

Not a test module. MTP layers are added by their checkpoint names in the DeepSeek layout, written here
independently of mtpserve's weight_names.py: `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.norm}`
plus a whole decoder layer under the same prefix, with the MoE block (as GLM-4.5 ships it: the MTP layer
comes after the first dense layers). Routed expert tensors are per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), as transformers' save_pretrained writes them.

`predictable=True` shapes the weights so that a random model still speculates: the residual branches
are damped, a permutation of the embedding is mixed into the head (the next token leans towards a fixed
function of the current one) and each MTP module's eh_proj passes the token embedding through, so
module k guesses t_{i+k+2} from t_{i+k+1} right often but not always (accepted counts 0..3 all occur).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.checkpoints import (
    DEEPSEEK_MTP_PARTS, _quiet_transformers, _random_like, read_tensors, write_tensors, write_tokenizer,
)

_COMMON: dict[str, Any] = dict(
    vocab_size=97, hidden_size=64, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=24,
    n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
BASE: dict[str, dict[str, Any]] = {
    "glm4_moe": dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                     attention_bias=True, use_qk_norm=False),
    "deepseek_v3": dict(_COMMON, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12),
}
_CLASSES = {"glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"), "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}

DAMPING = 0.5  # residual branches shrink so the token embedding dominates the hidden state
HEAD_MIX = 0.15  # weight of the permuted embedding added to the random head
_DAMPED = ("o_proj.weight", "down_proj.weight")


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, predictable: bool) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return 0.3 * torch.randn(shape, generator=gen)  # large enough to change which experts win
    t = _random_like(name, shape, gen)
    return DAMPING * t if predictable and name.endswith(_DAMPED) else t


def make_moe_checkpoint(path: str | Path, family: str = "glm4_moe", num_mtp: int = 0, seed: int = 0, *,
                        predictable: bool = False, tokenizer: bool = False, **overrides: Any) -> Path:
    """Build a tiny random model of `family` ("glm4_moe" or "deepseek_v3"; BASE[family] updated with
    `overrides`, e.g. rope_scaling=... for YaRN) and save it at `path`."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {**BASE[family], **overrides}
    _quiet_transformers()
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[family])
    model = model_cls(config_cls(**kwargs)).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    model.save_pretrained(path)  # for the released tensor names and config.json; the weights are redrawn
    saved = read_tensors(path)
    # Zero-size tensors (shared experts when there are none) are not in a real checkpoint.
    tensors = {name: _draw(name, tuple(t.shape), gen, predictable) for name, t in sorted(saved.items()) if t.numel()}
    hidden, layers, vocab = kwargs["hidden_size"], kwargs["num_hidden_layers"], kwargs["vocab_size"]
    if predictable:
        perm = torch.randperm(vocab, generator=gen)
        tensors["lm_head.weight"] += HEAD_MIX * tensors["model.embed_tokens.weight"][perm]
    last = f"model.layers.{layers - 1}."
    block = {n[len(last):]: tuple(t.shape) for n, t in tensors.items() if n.startswith(last)}
    for k in range(num_mtp):
        prefix = f"model.layers.{layers + k}."
        for name, shape in block.items():
            tensors[prefix + name] = _draw(name, shape, gen, predictable)
        enorm, hnorm, proj, head_norm = DEEPSEEK_MTP_PARTS
        for part in (enorm, hnorm, head_norm):
            tensors[f"{prefix}{part}.weight"] = _random_like("norm.weight", (hidden,), gen)
        eh = _random_like("proj.weight", (hidden, 2 * hidden), gen, matrix_std=0.08)
        if predictable:
            eh[:, :hidden] += torch.eye(hidden)  # (emb, hidden) order: the token embedding passes through
        tensors[f"{prefix}{proj}.weight"] = eh
    write_tensors(path / "model.safetensors", tensors)
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = num_mtp
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(path, vocab)
    return path
