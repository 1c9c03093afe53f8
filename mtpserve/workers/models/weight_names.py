"""Per-architecture maps from checkpoint tensor names to our parameters.

Each entry says which checkpoint tensor fills which rows of which parameter, and the shape it must
have. q/k/v land in the fused qkv_proj and gate/up in the fused gate_up_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtpserve.workers.models.config import ModelConfig


@dataclass(frozen=True)
class WeightSpec:
    ckpt_name: str
    param: str  # our parameter name
    shape: tuple[int, ...]
    row_offset: int | None = None  # set when the tensor fills a slice of a fused parameter
    optional: bool = False  # a per-module copy of a shared tensor: loaded only when present


def _block(cfg: ModelConfig, src: str, dst: str) -> list[WeightSpec]:
    """A decoder block's tensors: HF names under prefix `src`, ours under prefix `dst`."""
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    specs = [
        WeightSpec(f"{src}input_layernorm.weight", f"{dst}input_layernorm.weight", (hidden,)),
        WeightSpec(f"{src}post_attention_layernorm.weight", f"{dst}post_attention_layernorm.weight", (hidden,)),
        WeightSpec(f"{src}self_attn.o_proj.weight", f"{dst}self_attn.o_proj.weight", (hidden, q)),
        WeightSpec(f"{src}mlp.down_proj.weight", f"{dst}mlp.down_proj.weight", (hidden, inter)),
        WeightSpec(f"{src}mlp.gate_proj.weight", f"{dst}mlp.gate_up_proj.weight", (inter, hidden), 0),
        WeightSpec(f"{src}mlp.up_proj.weight", f"{dst}mlp.gate_up_proj.weight", (inter, hidden), inter),
    ]
    for name, offset, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
        specs.append(WeightSpec(f"{src}self_attn.{name}_proj.weight", f"{dst}self_attn.qkv_proj.weight", (rows, hidden), offset))
        if cfg.qkv_bias:
            specs.append(WeightSpec(f"{src}self_attn.{name}_proj.bias", f"{dst}self_attn.qkv_proj.bias", (rows,), offset))
    if cfg.o_bias:
        specs.append(WeightSpec(f"{src}self_attn.o_proj.bias", f"{dst}self_attn.o_proj.bias", (hidden,)))
    if cfg.qk_norm:
        specs.append(WeightSpec(f"{src}self_attn.q_norm.weight", f"{dst}self_attn.q_norm.weight", (d,)))
        specs.append(WeightSpec(f"{src}self_attn.k_norm.weight", f"{dst}self_attn.k_norm.weight", (d,)))
    return specs


def target_specs(cfg: ModelConfig) -> list[WeightSpec]:
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    specs = [
        WeightSpec("model.embed_tokens.weight", "embed_tokens.weight", (vocab, hidden)),
        WeightSpec("model.norm.weight", "norm.weight", (hidden,)),
    ]
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", "lm_head.weight", (vocab, hidden)))
    for i in range(cfg.num_layers):
        specs += _block(cfg, f"model.layers.{i}.", f"layers.{i}.")
    return specs


# (our name inside an MTP module, DeepSeek-style name, MiMo-style name)
_MTP_PARTS = (
    ("enorm.weight", "enorm.weight", "token_layernorm.weight"),
    ("hnorm.weight", "hnorm.weight", "hidden_layernorm.weight"),
    ("eh_proj.weight", "eh_proj.weight", "input_proj.weight"),
    ("norm.weight", "shared_head.norm.weight", "final_layernorm.weight"),
)


def mtp_specs(cfg: ModelConfig) -> list[WeightSpec]:
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    shapes = {"eh_proj.weight": (hidden, 2 * hidden)}
    specs: list[WeightSpec] = []
    for k in range(cfg.mtp.num_modules):
        deepseek = cfg.mtp.layout == "deepseek"
        src = f"model.layers.{cfg.num_layers + k}." if deepseek else f"model.mtp_layers.{k}."
        dst = f"mtp.{k}."
        for ours, ds_name, mimo_name in _MTP_PARTS:
            name = ds_name if deepseek else mimo_name
            specs.append(WeightSpec(src + name, dst + ours, shapes.get(ours, (hidden,))))
        specs += _block(cfg, src, dst + "block.")
        if deepseek:
            specs.append(WeightSpec(src + "embed_tokens.weight", dst + "embed_tokens.weight", (vocab, hidden), optional=True))
            specs.append(WeightSpec(src + "shared_head.head.weight", dst + "head.weight", (vocab, hidden), optional=True))
    return specs
