"""Reference layout of the window passes of a uniform step's MTP chain (mtpserve/workers/uniform_chain.py).

Window pass p runs module p over q_p = window + p rows per request at positions N - 1 - p + j (N: the
request's verified tokens before the step), in KV group 1 + p. Its rows may write KV where the request's
chain reaches module p (num_spec > p) and the position lies inside the blocks it owns there. Per pass
this is `window_metadata_ref` of that group; around it the chain needs, once per step:
  tokens     [B, window + P] int64  row j holds t_{N+j}: the emitted tokens, then zeros the drafts replace
  draft_at   [P, B] int64   flat index into `tokens` where draft p goes (row a + p + 1 of request b)
  rows       [P, 2, B] int64  flat rows of pass p's output [B * q_p]: the drafting row a + p, and row a
                              (g^p at the module's new last committed position: the carry)
  used       [P, B] bool    whether the request's chain reaches module p
With a = accepted [B]. Positions and slot mappings of every pass are one flat buffer, pass after pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.kernels.window_metadata_ref import window_metadata_ref


@dataclass
class ChainLayout:
    window: int
    positions: torch.Tensor  # [B * sum_p q_p] int64, pass after pass
    slot_mapping: torch.Tensor  # same layout, -1 where a row writes no KV
    seq_lens: torch.Tensor  # [P, B] int32
    query_start_loc: torch.Tensor  # [P, B + 1] int32
    block_tables: torch.Tensor  # [P, B, max_blocks] int32: each pass's group's rows of the batch
    tokens: torch.Tensor  # [B, window + P] int64
    draft_at: torch.Tensor  # [P, B] int64
    rows: torch.Tensor  # [P, 2, B] int64
    used: torch.Tensor  # [P, B] bool

    def span(self, p: int) -> slice:
        """Where pass p's rows sit in `positions` and `slot_mapping`."""
        batch = self.seq_lens.shape[1]
        start = batch * (p * self.window + p * (p - 1) // 2)
        return slice(start, start + batch * (self.window + p))


def chain_layout_ref(tables: torch.Tensor, capacity: torch.Tensor, num_spec: torch.Tensor, slots: torch.Tensor,
                     seq_len: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor, passes: int,
                     block_size: int) -> ChainLayout:
    """tables [G, S, MB] int32 and capacity [G, S] int64 of every KV group (group 1 + p is module p's);
    num_spec [S] int64; slots, seq_len, accepted [B] int64; emitted [B, window] int64; passes P >= 1."""
    batch, window = emitted.shape
    dev = slots.device
    pos, slot_mapping, seq_lens, qsl, bts, used = [], [], [], [], [], []
    for p in range(passes):
        q = window + p
        reaches = num_spec[slots] > p
        meta = window_metadata_ref(tables[1 + p], capacity[1 + p], slots, seq_len - 1 - p, reaches * q, q, block_size)
        pos.append(meta[0])
        slot_mapping.append(meta[1])
        seq_lens.append(meta[2])
        qsl.append(meta[3])
        bts.append(tables[1 + p, slots])
        used.append(reaches)
    ps = torch.arange(passes, device=dev)[:, None]  # [P, 1]
    starts = torch.arange(batch, device=dev) * (window + ps)  # [P, B]: each request's first row in pass p
    return ChainLayout(
        window=window, positions=torch.cat(pos), slot_mapping=torch.cat(slot_mapping), seq_lens=torch.stack(seq_lens),
        query_start_loc=torch.stack(qsl), block_tables=torch.stack(bts),
        tokens=torch.cat((emitted, emitted.new_zeros(batch, passes)), dim=1),
        draft_at=torch.arange(batch, device=dev) * (window + passes) + accepted + ps + 1,
        rows=torch.stack((starts + accepted + ps, starts + accepted), dim=1), used=torch.stack(used))
