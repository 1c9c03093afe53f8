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
    index: int | None = None  # set when the tensor is one expert's slice of a stacked [E, ...] parameter


def _mlp(src: str, dst: str, hidden: int, inter: int, index: int | None = None) -> list[WeightSpec]:
    """A SwiGLU MLP's three tensors (HF names under `src`) into our fused gate_up_proj and down_proj;
    with `index`, into expert `index` of the stacked parameters dst+gate_up_proj / dst+down_proj."""
    weight = "" if index is not None else ".weight"
    return [
        WeightSpec(f"{src}down_proj.weight", f"{dst}down_proj{weight}", (hidden, inter), index=index),
        WeightSpec(f"{src}gate_proj.weight", f"{dst}gate_up_proj{weight}", (inter, hidden), 0, index=index),
        WeightSpec(f"{src}up_proj.weight", f"{dst}gate_up_proj{weight}", (inter, hidden), inter, index=index),
    ]


def _moe(cfg: ModelConfig, src: str, dst: str) -> list[WeightSpec]:
    """The MoE block under `src`mlp.: router, per-expert tensors into stacked parameters, shared experts."""
    moe, hidden = cfg.moe, cfg.hidden_size
    assert moe is not None
    specs = [
        WeightSpec(f"{src}mlp.gate.weight", f"{dst}mlp.gate.weight", (moe.num_experts, hidden)),
        WeightSpec(f"{src}mlp.gate.e_score_correction_bias", f"{dst}mlp.gate.e_score_correction_bias", (moe.num_experts,)),
    ]
    for e in range(moe.num_experts):
        specs += _mlp(f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.", hidden, moe.intermediate_size, index=e)
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * moe.intermediate_size
        specs += _mlp(f"{src}mlp.shared_experts.", f"{dst}mlp.shared_experts.", hidden, shared)
    return specs


def _block(cfg: ModelConfig, src: str, dst: str, index: int) -> list[WeightSpec]:
    """A decoder block's tensors: HF names under prefix `src`, ours under prefix `dst`; `index` is the
    block's layer number in the checkpoint (it decides dense MLP or MoE)."""
    hidden = cfg.hidden_size
    specs = [
        WeightSpec(f"{src}input_layernorm.weight", f"{dst}input_layernorm.weight", (hidden,)),
        WeightSpec(f"{src}post_attention_layernorm.weight", f"{dst}post_attention_layernorm.weight", (hidden,)),
    ]
    specs += _mla(cfg, src + "self_attn.", dst + "self_attn.") if cfg.mla else _gqa(cfg, src, dst)
    if cfg.moe is not None and cfg.moe.is_moe_layer(index):
        specs += _moe(cfg, src, dst)
    else:
        specs += _mlp(f"{src}mlp.", f"{dst}mlp.", hidden, cfg.intermediate_size)
    return specs


def _gqa(cfg: ModelConfig, src: str, dst: str) -> list[WeightSpec]:
    hidden, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    specs = [WeightSpec(f"{src}self_attn.o_proj.weight", f"{dst}self_attn.o_proj.weight", (hidden, q))]
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


def _mla(cfg: ModelConfig, src: str, dst: str) -> list[WeightSpec]:
    """Multi-head latent attention: the tensors keep their checkpoint names (prefix self_attn.)."""
    mla, hidden, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    assert mla is not None
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "kv_a_proj_with_mqa.weight": (mla.latent_dim, hidden),
        "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes["q_proj.weight"] = (heads * qk, hidden)
    else:
        shapes["q_a_proj.weight"] = (mla.q_lora_rank, hidden)
        shapes["q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes["q_b_proj.weight"] = (heads * qk, mla.q_lora_rank)
    if cfg.qkv_bias:
        shapes["kv_a_proj_with_mqa.bias"] = (mla.latent_dim,)
        if mla.q_lora_rank is not None:
            shapes["q_a_proj.bias"] = (mla.q_lora_rank,)
    if cfg.o_bias:
        shapes["o_proj.bias"] = (hidden,)
    return [WeightSpec(src + name, dst + name, shape) for name, shape in shapes.items()]


def target_specs(cfg: ModelConfig) -> list[WeightSpec]:
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    specs = [
        WeightSpec("model.embed_tokens.weight", "embed_tokens.weight", (vocab, hidden)),
        WeightSpec("model.norm.weight", "norm.weight", (hidden,)),
    ]
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", "lm_head.weight", (vocab, hidden)))
    for i in range(cfg.num_layers):
        specs += _block(cfg, f"model.layers.{i}.", f"layers.{i}.", i)
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
        specs += _block(cfg, src, dst + "block.", cfg.num_layers + k)
        if deepseek:
            specs.append(WeightSpec(src + "embed_tokens.weight", dst + "embed_tokens.weight", (vocab, hidden), optional=True))
            specs.append(WeightSpec(src + "shared_head.head.weight", dst + "head.weight", (vocab, hidden), optional=True))
    return specs
