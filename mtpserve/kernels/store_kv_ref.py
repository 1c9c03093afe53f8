"""Plain-torch write of new K/V rows into the paged cache by slot: the CPU path and the kernel's oracle.

  key/value       [T, Hkv, D]
  k_cache/v_cache [NB, BS, Hkv, D]
  slot_mapping    [T] int64, slot = block * BS + offset; rows with slot < 0 are skipped
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep].to(v_cache.dtype))
