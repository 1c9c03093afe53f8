"""Model configuration parsed from a Hugging Face config.json (target decoder plus MTP modules)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpserve.errors import CheckpointError

# Architectures whose target decoder we implement, with their per-family defaults.
_FAMILIES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "MiMoForCausalLM": {"qkv_bias": True, "qk_norm": False},  # Qwen2 body with MTP layers
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    # GLM-4.5 / 4.6: q/k norm only when use_qk_norm says so; o_proj never has a bias.
    "Glm4MoeForCausalLM": {"qkv_bias": False, "qk_norm": False},
    # DeepSeek-V3 / R1: multi-head latent attention; attention_bias covers q_a, kv_a and o.
    "DeepseekV3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
}
_MOE_FAMILIES = ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")

# Quantization methods a checkpoint may declare; every other one is refused by name.
_SUPPORTED_QUANTIZATION = ("fp8",)


@dataclass(frozen=True)
class FP8Config:
    """DeepSeek-V3-style block-scaled FP8 weights: a quantised `X.weight` (float8_e4m3fn) comes with
    `X.weight_scale_inv`, one fp32 scale per block of `block` = (rows, cols); weight = fp8 * scale."""

    block: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default", "llama3" or "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    partial_rotary_factor: float = 1.0  # rotate only the first head_dim * factor dims of each head
    # YaRN (DeepSeek-V3): the ramp between extrapolated and interpolated frequencies, and the mscales.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # cos/sin multiplier; derived from the mscales when None


@dataclass(frozen=True)
class MTPConfig:
    """How the checkpoint's MTP modules are laid out and wired (docs/design.md §3)."""

    num_modules: int = 0
    layout: str = "deepseek"  # "deepseek": model.layers.{L+k}.*; "mimo": model.mtp_layers.{k}.*
    hidden_first: bool = False  # concat order inside eh_proj: (hidden, emb) instead of (emb, hidden)
    hidden_pre_norm: bool = False  # target hidden taken before the final norm
    pass_normed: bool = False  # next module receives norm_k(g) instead of g
    mask_position0: bool = True  # zero the token embedding at position 0


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (DeepSeek-V3 / GLM-4.5 style): sigmoid scores, grouped top-k, shared experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    num_shared_experts: int
    first_dense_layers: int  # layers 0 .. first_dense_layers-1 keep the dense MLP
    num_groups: int = 1
    top_k_groups: int = 1
    norm_top_k: bool = True
    routed_scaling: float = 1.0

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (MTP blocks count on from num_layers) has the MoE block."""
        return index >= self.first_dense_layers


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a per-token latent."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rope dims are (x0, x1), (x2, x3), ... pairs

    @property
    def latent_dim(self) -> int:
        """Width of one token's KV entry: the normalised latent, then the rotated shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rope: RopeConfig
    mtp: MTPConfig = field(default_factory=MTPConfig)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # when set: head_dim is the rope width and the KV pool has one "head"
    fp8: FP8Config | None = None  # quantised tensors are those the checkpoint gives a weight_scale_inv

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"no config.json in checkpoint directory {path}")
        return ModelConfig.from_dict(json.loads(cfg_path.read_text()))

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(raw)
        family = _FAMILIES[arch]
        num_heads = _required(raw, "num_attention_heads")
        hidden = _required(raw, "hidden_size")
        attention_bias = bool(raw.get("attention_bias", False))
        if raw.get("mlp_bias"):
            raise CheckpointError("config field 'mlp_bias': MLP biases are not supported")
        glm = arch == "Glm4MoeForCausalLM"
        mla = _mla(raw) if arch == "DeepseekV3ForCausalLM" else None
        return ModelConfig(
            architecture=arch,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_layers=_required(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=1 if mla else raw.get("num_key_value_heads") or num_heads,
            head_dim=mla.qk_rope_head_dim if mla else raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family["qkv_bias"] or attention_bias,
            o_bias=attention_bias and arch not in ("Qwen2ForCausalLM", "Glm4MoeForCausalLM"),
            qk_norm=family["qk_norm"] or (glm and bool(raw.get("use_qk_norm", False))),
            rope=_rope(raw),
            mtp=_mtp(raw, arch),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            moe=_moe(raw) if arch in _MOE_FAMILIES else None,
            mla=mla,
            fp8=_quantization(raw),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token per layer at one byte per element (multiply by dtype size)."""
        if self.mla is not None:
            return self.mla.latent_dim  # one entry serves as key and (its latent part) as value
        return 2 * self.num_kv_heads * self.head_dim


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if not archs:
        raise CheckpointError("config field 'architectures' is missing")
    for arch in archs:
        if arch in _FAMILIES:
            return arch
    raise CheckpointError(
        f"config field 'architectures': unsupported architecture {archs}; supported: {sorted(_FAMILIES)}"
    )


def _required(raw: dict[str, Any], key: str) -> int:
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"config field '{key}' is missing")
    return int(raw[key])


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs write rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    # GLM-4.5 writes partial_rotary_factor at the top level; transformers >= 5 inside rope_parameters.
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise CheckpointError(f"config field 'partial_rotary_factor': {partial} is not in (0, 1]")
    if kind == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if kind == "llama3":
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in needed if key not in params]
        if missing:
            raise CheckpointError(f"config field 'rope_scaling': llama3 rope needs {missing}")
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
            partial_rotary_factor=partial,
        )
    if kind == "yarn":
        return _yarn(params, theta, partial)
    raise CheckpointError(f"config field 'rope_scaling': unsupported rope type {kind!r}")


def _mtp(raw: dict[str, Any], arch: str) -> MTPConfig:
    num = int(raw.get("num_nextn_predict_layers", 0) or 0)
    mimo = arch == "MiMoForCausalLM" or raw.get("mtp_layout") == "mimo"
    defaults = MTPConfig(
        num_modules=num,
        layout="mimo" if mimo else "deepseek",
        hidden_first=mimo,
        hidden_pre_norm=mimo,
        pass_normed=mimo,
        mask_position0=True,
    )
    # Our own checkpoints may state the wiring explicitly; these keys win over the layout defaults.
    return MTPConfig(
        num_modules=num,
        layout=defaults.layout,
        hidden_first=bool(raw.get("mtp_hidden_first", defaults.hidden_first)),
        hidden_pre_norm=bool(raw.get("mtp_hidden_pre_norm", defaults.hidden_pre_norm)),
        pass_normed=bool(raw.get("mtp_pass_normed", defaults.pass_normed)),
        mask_position0=bool(raw.get("mtp_mask_position0", defaults.mask_position0)),
    )


def _quantization(raw: dict[str, Any]) -> FP8Config | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in _SUPPORTED_QUANTIZATION:
        raise CheckpointError(f"config field 'quantization_config': quantization method {method!r} is not supported "
                              f"(supported: {', '.join(_SUPPORTED_QUANTIZATION)} with weight_block_size)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"config field 'quantization_config': fp8 activation_scheme "
                              f"{quant['activation_scheme']!r} is not supported (only 'dynamic')")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"config field 'quantization_config': fp8 fmt {quant['fmt']!r} is not supported (only 'e4m3')")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"config field 'quantization_config': fp8 needs weight_block_size [rows, cols], got {block!r}")
    return FP8Config(block=(block[0], block[1]))


def _moe(raw: dict[str, Any]) -> MoEConfig:
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise CheckpointError(f"config field 'topk_method': {topk_method!r} is not supported (only 'noaux_tc')")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"config field 'scoring_func': {raw['scoring_func']!r} is not supported (only 'sigmoid')")
    moe = MoEConfig(
        num_experts=_required(raw, "n_routed_experts"),
        top_k=_required(raw, "num_experts_per_tok"),
        intermediate_size=_required(raw, "moe_intermediate_size"),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_dense_layers=int(raw.get("first_k_dense_replace") or 0),
        num_groups=int(raw.get("n_group") or 1),
        top_k_groups=int(raw.get("topk_group") or 1),
        norm_top_k=bool(raw.get("norm_topk_prob", True)),
        routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
    )
    if moe.num_experts % moe.num_groups:
        raise CheckpointError(f"config field 'n_group': {moe.num_groups} does not divide n_routed_experts ({moe.num_experts})")
    if not 0 < moe.top_k_groups <= moe.num_groups:
        raise CheckpointError(f"config field 'topk_group': {moe.top_k_groups} is not in 1..n_group ({moe.num_groups})")
    per_group = moe.num_experts // moe.num_groups
    if moe.num_groups > 1 and per_group < 2:
        raise CheckpointError("config field 'n_group': each expert group needs at least 2 experts (groups are scored by their top 2)")
    if not 0 < moe.top_k <= moe.top_k_groups * per_group:
        raise CheckpointError(
            f"config field 'num_experts_per_tok': {moe.top_k} experts cannot be chosen from {moe.top_k_groups} groups of {per_group}"
        )
    return moe


def _yarn(params: dict[str, Any], theta: float, partial: float) -> RopeConfig:
    missing = [key for key in ("factor", "original_max_position_embeddings") if key not in params]
    if missing:
        raise CheckpointError(f"config field 'rope_scaling': yarn rope needs {missing}")
    factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=float(params["factor"]),
        original_max_position=int(params["original_max_position_embeddings"]),
        partial_rotary_factor=partial,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if factor is None else float(factor),
    )


def _mla(raw: dict[str, Any]) -> MLAConfig:
    q_lora = raw.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=_required(raw, "kv_lora_rank"),
        qk_nope_head_dim=_required(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_required(raw, "qk_rope_head_dim"),
        v_head_dim=_required(raw, "v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
