"""Reference metadata of a batch of query windows: positions, KV slots, context lengths, query offsets.

Request b's window is q rows at positions first_pos[b] .. first_pos[b] + q - 1 (>= 0). Row j writes
its KV when j < limit[b] and its position lies inside the blocks the request owns (capacity); then
its slot is tables[slot_b, pos // BS] * BS + pos % BS, else -1 (the store skips it).
  tables        [S, MB] int32  one KV group's block table per slot
  capacity      [S] int64      positions the slot owns in that group
  slots         [B] int64      the requests' slots
  first_pos     [B] int64
  limit         [B] int64      rows of the window that may write
  -> positions [B * q] int64, slot_mapping [B * q] int64, seq_lens [B] int32 (first_pos + q),
     query_start_loc [B + 1] int32 (b * q)
"""

from __future__ import annotations

import torch


def window_metadata_ref(tables: torch.Tensor, capacity: torch.Tensor, slots: torch.Tensor, first_pos: torch.Tensor,
                        limit: torch.Tensor, q: int, block_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, dev = slots.shape[0], slots.device
    j = torch.arange(q, device=dev)
    pos = first_pos[:, None] + j  # [B, q]
    blocks = tables[slots].gather(1, (pos // block_size).clamp(0, tables.shape[1] - 1)).long()
    owned = (j < limit[:, None]) & (pos < capacity[slots][:, None])
    slot_mapping = torch.where(owned, blocks * block_size + pos % block_size, -1)
    seq_lens = (first_pos + q).to(torch.int32)
    query_start_loc = torch.arange(0, (batch + 1) * q, q, dtype=torch.int32, device=dev)
    return pos.reshape(-1), slot_mapping.reshape(-1), seq_lens, query_start_loc
