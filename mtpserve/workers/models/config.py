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
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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
        return ModelConfig(
            architecture=arch,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_layers=_required(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family["qkv_bias"] or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            qk_norm=family["qk_norm"],
            rope=_rope(raw),
            mtp=_mtp(raw, arch),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token per layer at one byte per element (multiply by dtype size)."""
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
    if kind == "default":
        return RopeConfig(theta=theta)
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
        )
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
