"""The target model: a Llama / Qwen2 / Qwen3 / GLM-4.5 (MoE) decoder over flat batches with a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.kernels.linear_dispatch import DispatchedLinear
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS
from mtpserve.workers.attention import AttentionMetadata, LayerKV
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Slack past max_position: the drafter writes a few positions beyond the last verified one.
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position + 2 * MAX_SPECULATIVE_TOKENS)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = DispatchedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: list[LayerKV]
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states before the final norm, [T, hidden]."""
        x, delta = self._layers(input_ids, positions, meta, kv)
        return x if delta is None else x + delta

    def forward_normed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv: list[LayerKV]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, and its final norm: (hidden [T, hidden], norm(hidden)); the last residual add and the norm
        are one kernel on CUDA, rounded as the separate add."""
        x, delta = self._layers(input_ids, positions, meta, kv)
        return (x, self.norm(x)) if delta is None else self.norm.add_norm(x, delta)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: list[LayerKV]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers -> (x, delta): the hidden states are x + delta, the last add left to the caller."""
        x, delta = self.embed_tokens(input_ids), None
        for layer, layer_kv in zip(self.layers, kv):
            x, delta = layer.forward_residual(x, delta, positions, meta, layer_kv)
        return x, delta

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Pre-norm hidden rows [n, hidden] -> logits [n, vocab]: fp32, or the head's dtype."""
        return self.head_logits(self.norm(hidden), fp32)

    def head_logits(self, normed: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Normed hidden rows [n, hidden] -> logits [n, vocab]: fp32, or the head's dtype."""
        out = self.lm_head(normed)
        return out.float() if fp32 else out
