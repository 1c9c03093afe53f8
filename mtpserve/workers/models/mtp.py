"""MTP modules (docs/design.md §3): enorm, hnorm, eh_proj, one decoder block and the head norm per module.

Module k at position i:  x = eh_proj(cat(enorm(Emb(t_{i+k+1})), hnorm(g^{k-1}_i)))   (order per architecture)
                         g^k_i = Block_k(x);  logits^k = Head(norm_k(g^k_i)) predicts t_{i+k+2}
The embedding and output head are the target's unless the checkpoint gives a module its own.
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.kernels import use_fused
from mtpserve.kernels.linear_dispatch import DispatchedLinear
from mtpserve.kernels.mtp_input_ref import mtp_input_ref
from mtpserve.workers.attention import AttentionMetadata, LayerKV
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = DispatchedLinear(2 * hidden, hidden, bias=False)
        self.block = DecoderLayer(cfg, rotary, cfg.num_layers + index)  # MoE when the target's last layers are
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        # Set by the loader only when the checkpoint carries per-module copies.
        self.embed_tokens: nn.Embedding | None = None
        self.head: nn.Linear | None = None


class MTPStack(nn.Module):
    """All MTP modules of a checkpoint; the target's embedding and head are passed in, not owned."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.mtp = nn.ModuleList(MTPModule(cfg, rotary, k) for k in range(cfg.mtp.num_modules))

    def __len__(self) -> int:
        return len(self.mtp)

    def forward(
        self,
        k: int,
        token_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: LayerKV,
        embed: nn.Embedding,
        first_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run module k over rows -> g^k [T, H]: token_ids [T] (t_{i+k+1}) with prev_hidden [T, H], or a
        window of Q rows per request, token_ids [B, Q] with prev_hidden [B, P, H] (and first_hidden [B, H]
        shifted in front: mtpserve/kernels/mtp_input_ref.py). On CUDA the input is one kernel."""
        module = self.mtp[k]
        if token_ids.dim() == 1:
            token_ids, prev_hidden = token_ids[:, None], prev_hidden[:, None]
        table = module.embed_tokens or embed
        fused = use_fused(prev_hidden) and type(table) is nn.Embedding  # not a vocabulary-parallel lookup
        build = mtp_input_ref
        if fused:  # imported here: triton is imported only where a kernel runs
            from mtpserve.kernels.mtp_input import mtp_input as build
        x = build(token_ids, positions, table.weight if fused else table, prev_hidden, first_hidden,
                  module.enorm.weight, module.hnorm.weight, module.enorm.eps, self.cfg.mtp.mask_position0,
                  self.cfg.mtp.hidden_first)
        return module.block(module.eh_proj(x), positions, meta, kv)

    def next_hidden(self, k: int, g: torch.Tensor) -> torch.Tensor:
        """What module k hands to module k+1 (or to its own next recursive step)."""
        return self.mtp[k].norm(g) if self.cfg.mtp.pass_normed else g

    def logits(self, k: int, g: torch.Tensor, head: nn.Linear, fp32: bool = True) -> torch.Tensor:
        """g^k rows [n, H] -> logits [n, vocab] predicting t_{i+k+2}: fp32, or the head's dtype."""
        module = self.mtp[k]
        out = (module.head or head)(module.norm(g))
        return out.float() if fp32 else out
