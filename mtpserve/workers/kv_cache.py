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
        heads = num_kv_heads or cfg.num_kv_heads

        def layer() -> LayerKV:
            shape = (num_blocks, block_size, heads, cfg.head_dim)
            return LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

        return KVPools([layer() for _ in range(cfg.num_layers)], [layer() for _ in range(num_modules)])


def bytes_per_block(cfg: ModelConfig, block_size: int, num_modules: int, dtype: torch.dtype) -> int:
    """Bytes one block index costs across every group (target layers plus each MTP module)."""
    per_layer = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    return per_layer * (cfg.num_layers + num_modules)
