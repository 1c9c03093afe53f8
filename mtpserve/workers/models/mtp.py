"""MTP modules (docs/design.md §3): enorm, hnorm, eh_proj, one decoder block and the head norm per module.

Module k at position i:  x = eh_proj(cat(enorm(Emb(t_{i+k+1})), hnorm(g^{k-1}_i)))   (order per architecture)
                         g^k_i = Block_k(x);  logits^k = Head(norm_k(g^k_i)) predicts t_{i+k+2}
The embedding and output head are the target's unless the checkpoint gives a module its own.
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.kernels.linear_dispatch import DispatchedLinear
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
    ) -> torch.Tensor:
        """Run module k over flat rows: token_ids [T] (t_{i+k+1}), prev_hidden [T, H] -> g^k [T, H]."""
        module = self.mtp[k]
        emb = (module.embed_tokens or embed)(token_ids)
        if self.cfg.mtp.mask_position0:
            emb = emb.masked_fill((positions == 0)[:, None], 0.0)
        e, h = module.enorm(emb), module.hnorm(prev_hidden)
        x = module.eh_proj(torch.cat((h, e) if self.cfg.mtp.hidden_first else (e, h), dim=-1))
        return module.block(x, positions, meta, kv)

    def next_hidden(self, k: int, g: torch.Tensor) -> torch.Tensor:
        """What module k hands to module k+1 (or to its own next recursive step)."""
        return self.mtp[k].norm(g) if self.cfg.mtp.pass_normed else g

    def logits(self, k: int, g: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        """g^k rows [n, H] -> fp32 logits [n, vocab] predicting t_{i+k+2}."""
        module = self.mtp[k]
        return (module.head or head)(module.norm(g)).float()
