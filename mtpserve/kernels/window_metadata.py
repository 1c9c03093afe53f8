"""Triton metadata of a batch of query windows in one launch (drop-in for `window_metadata_ref`).

A uniform step builds this for the target and for every module pass of its chain; as a dozen small
torch ops it cost a dozen kernel launches each time, a few microseconds apiece inside a CUDA graph,
which on small models is most of a module pass. One program per request writes its window's rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# q and num_reqs stay runtime ints even when 1: Triton would otherwise fold them into constants, where the
# int arithmetic below is Python's, not a tensor's.
@triton.jit(do_not_specialize=["q", "num_reqs"])
def _window_metadata_kernel(
    tables_ptr, capacity_ptr, slots_ptr, first_ptr, limit_ptr,
    pos_ptr, slot_mapping_ptr, seq_lens_ptr, qsl_ptr,
    stride_table, q, num_reqs,
    MAX_BLOCKS: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    first = tl.load(first_ptr + b).to(tl.int64)
    limit = tl.load(limit_ptr + b).to(tl.int64)
    capacity = tl.load(capacity_ptr + slot).to(tl.int64)
    j = tl.arange(0, BLOCK_Q)  # [BLOCK_Q] rows of the window
    in_window = j < q
    pos = first + j
    col = tl.minimum(tl.maximum(pos // PAGE, 0), MAX_BLOCKS - 1)
    block = tl.load(tables_ptr + slot * stride_table + col, mask=in_window, other=0).to(tl.int64)
    owned = (j < limit) & (pos < capacity)
    slot_mapping = tl.where(owned, block * PAGE + pos % PAGE, -1)
    out = b.to(tl.int64) * q + j
    tl.store(pos_ptr + out, pos, mask=in_window)
    tl.store(slot_mapping_ptr + out, slot_mapping, mask=in_window)
    tl.store(seq_lens_ptr + b, first + q)  # stores cast to the int32 outputs
    tl.store(qsl_ptr + b, b * q)
    if b == 0:
        tl.store(qsl_ptr + num_reqs, num_reqs * q)


def window_metadata(
    tables: torch.Tensor,  # [S, MB] int32, one KV group's table per slot (rows contiguous)
    capacity: torch.Tensor,  # [S] int64
    slots: torch.Tensor,  # [B] int64
    first_pos: torch.Tensor,  # [B] int64, >= 0
    limit: torch.Tensor,  # [B] int64
    q: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> positions [B * q] int64, slot_mapping [B * q] int64, seq_lens [B] int32, query_start_loc [B + 1] int32.
    Slots are not bounds-checked (that would need a device sync)."""
    batch, dev = slots.shape[0], slots.device
    if tables.stride(1) != 1:
        raise ValueError("tables need a unit stride along the blocks")
    if not (capacity.shape[0] == tables.shape[0] and first_pos.shape == limit.shape == (batch,)):
        raise ValueError(f"capacity {tuple(capacity.shape)}, first_pos {tuple(first_pos.shape)} and limit "
                         f"{tuple(limit.shape)} must match tables' {tables.shape[0]} slots and {batch} requests")
    positions = torch.empty(batch * q, dtype=torch.int64, device=dev)
    slot_mapping = torch.empty(batch * q, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(batch, dtype=torch.int32, device=dev)
    query_start_loc = torch.empty(batch + 1, dtype=torch.int32, device=dev)
    if batch == 0:
        query_start_loc.zero_()
        return positions, slot_mapping, seq_lens, query_start_loc
    _window_metadata_kernel[(batch,)](
        tables, capacity, slots, first_pos, limit, positions, slot_mapping, seq_lens, query_start_loc,
        tables.stride(0), q, batch,
        MAX_BLOCKS=tables.shape[1], PAGE=block_size, BLOCK_Q=triton.next_power_of_2(max(q, 1)), num_warps=1,
    )
    return positions, slot_mapping, seq_lens, query_start_loc
