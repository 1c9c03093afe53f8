"""Building blocks of the Llama / Qwen2 / Qwen3 decoder over flat batches.

Every module works on flat token rows [T, hidden]; attention goes through the paged KV cache.
Linears are plain nn.Linear (q/k/v and gate/up fused) so that tensor parallelism can be applied
afterwards as a separate pass over the unsharded model (mtpserve/workers/tensor_parallel.py); the
DispatchedLinear subclass only routes the product (mtpserve/kernels/linear_dispatch.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtpserve.kernels import use_fused
from mtpserve.kernels.linear_dispatch import DispatchedLinear  # nn.Linear; cuBLAS unless measured slower
from mtpserve.kernels.rmsnorm_ref import rms_norm_ref
from mtpserve.kernels.rope_ref import rope_ref
from mtpserve.kernels.silu_mul_ref import silu_mul_ref
from mtpserve.workers.attention import AttentionMetadata, LayerKV, attend, attend_stored
from mtpserve.workers.models.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do, then cast back (one kernel on CUDA).
        return _rms_norm(x)(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add and the next norm, fused on CUDA."""
        normed, summed = _rms_norm(x)(delta, self.weight, self.eps, residual=x)
        return summed, normed


def _rms_norm(x: torch.Tensor):
    if use_fused(x) and x.stride(-1) == 1 and x.dim() in (2, 3):
        from mtpserve.kernels.rmsnorm import rms_norm

        return rms_norm
    return rms_norm_ref


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The multiplier YaRN puts on cos and sin (1 for the other rope types)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_inv_freq(rope: RopeConfig, dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by `factor`), those turning more than beta_fast times kept, with a linear ramp between."""

    def dim_of(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(dim_of(rope.beta_fast)), 0)
    high = min(math.ceil(dim_of(rope.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq).float()
    if rope.kind == "llama3":
        # Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
        # and the band between is interpolated smoothly.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) RoPE with a precomputed cos/sin table indexed by absolute position.

    `head_dim` is the rotated width: with partial rotary (GLM-4.5) only the first `head_dim` dims of a
    wider head turn, the rest pass through unchanged."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_position = rope, head_dim, max_position
        self.register_buffer("cos", torch.empty(max_position, head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim // 2, dtype=torch.float32), persistent=False)
        if not self.cos.is_meta:
            self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """Fill the cos/sin tables (again after the module was built on the meta device)."""
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(self.cos.device)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=self.cos.device), inv_freq)
        scale = rope_attention_factor(self.rope)
        self.cos.copy_(freqs.cos() * scale)
        self.sin.copy_(freqs.sin() * scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D >= head_dim], positions: [T] -> x with its first head_dim dims rotated."""
        if use_fused(x) and x.dim() == 3 and x.stride(-1) == 1:  # one kernel instead of a dozen
            from mtpserve.kernels.rope import rope

            return rope(x, self.cos, self.sin, positions)
        return rope_ref(x, self.cos, self.sin, positions)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = DispatchedLinear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = DispatchedLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: LayerKV) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self._fused(q):  # q/k norm, RoPE and the KV store in one kernel
            from mtpserve.kernels.qk_norm_rope_store import qk_norm_rope_store

            norm = self.q_norm is not None
            q = qk_norm_rope_store(q, k, v, self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                                   self.q_norm.eps if norm else 0.0, self.rotary.cos, self.rotary.sin, positions,
                                   kv.k, kv.v, meta.slot_mapping)
            return self.o_proj(attend_stored(q, kv, meta, self.scale).reshape(-1, q_size))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        out = attend(q, k, v, kv, meta, self.scale)
        return self.o_proj(out.reshape(-1, q_size))

    def _fused(self, q: torch.Tensor) -> bool:
        """The fused kernel takes norm weights in q's own dtype (the unfused norm would promote others)."""
        norms = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        return use_fused(q) and all(w.dtype == q.dtype for w in norms)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = DispatchedLinear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = DispatchedLinear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_fused(gate_up):
            from mtpserve.kernels.silu_mul import silu_mul

            # The kernel takes rows [T, 2I]; training batches come as [B, S, 2I].
            return self.down_proj(silu_mul(gate_up.flatten(0, -2)).unflatten(0, gate_up.shape[:-1]))
        return self.down_proj(silu_mul_ref(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        """`index` is the layer's place in the checkpoint (an MTP block counts on from num_layers): it
        decides between the dense MLP and the MoE block."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: nn.Module = Attention(cfg, rotary)
        if cfg.mla is not None:
            from mtpserve.workers.models.mla import MLAttention  # mla.py builds on this module's parts

            self.self_attn = MLAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MLP(cfg)
        if cfg.moe is not None and cfg.moe.is_moe_layer(index):
            from mtpserve.workers.models.moe import MoE  # moe.py builds its shared experts from MLP

            self.mlp = MoE(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: LayerKV) -> torch.Tensor:
        x, delta = self.forward_residual(x, None, positions, meta, kv)
        return x + delta

    def forward_residual(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                         meta: AttentionMetadata, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on x + delta (delta None: on x), its own last residual add left to the caller: in a
        stack it is fused with the next layer's input norm, one kernel instead of two on CUDA, with the
        same rounding as the separate add."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_norm(x, delta)
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, positions, meta, kv))
        return x, self.mlp(h)
