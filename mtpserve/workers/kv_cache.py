"""The KV pools a worker holds: one per KV group (target layers, then one per MTP module)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.workers.attention import LayerKV
from mtpserve.workers.models.config import ModelConfig


@dataclass
class KVPools:
    target: list[LayerKV]  # one per decoder layer
    mtp: list[LayerKV]  # one per MTP module (each module is its own KV group)

    @staticmethod
    def allocate(cfg: ModelConfig, num_blocks: int, block_size: int, num_modules: int,
                 dtype: torch.dtype, device: torch.device, num_kv_heads: int | None = None) -> "KVPools":
        def layer() -> LayerKV:
            return layer_pool(cfg, num_blocks, block_size, dtype, device, num_kv_heads)

        return KVPools([layer() for _ in range(cfg.num_layers)], [layer() for _ in range(num_modules)])


def layer_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
               num_kv_heads: int | None = None) -> LayerKV:
    """One attention layer's pool: K and V [NB, BS, Hkv, D]; for latent attention (MLA) one tensor
    [NB, BS, 1, kv_lora_rank + rope] serving as both (its entries are the keys, their latent part the values)."""
    if cfg.mla is not None:
        latent = torch.zeros(num_blocks, block_size, 1, cfg.mla.latent_dim, dtype=dtype, device=device)
        return LayerKV(latent, latent)
    shape = (num_blocks, block_size, num_kv_heads or cfg.num_kv_heads, cfg.head_dim)
    return LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


def bytes_per_block(cfg: ModelConfig, block_size: int, num_modules: int, dtype: torch.dtype) -> int:
    """Bytes one block index costs across every group (target layers plus each MTP module)."""
    per_layer = block_size * cfg.kv_bytes_per_token * torch.finfo(dtype).bits // 8
    return per_layer * (cfg.num_layers + num_modules)
