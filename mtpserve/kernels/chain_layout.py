"""Triton layout of a uniform step's MTP window passes in one launch (drop-in for `chain_layout_ref`).

Per window pass the chain needs its rows' positions and KV slots, its group's block tables of the batch,
the rows to read back (drafting row, carry row), whether each request reaches the module, and once per
step the token rows. As torch ops that was two launches per pass and about fifteen per step, a few
microseconds each inside a CUDA graph: on small models a fifth of a module pass. Program (b, p) writes
request b's part of pass p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels.chain_layout_ref import ChainLayout


# window, num_reqs and num_slots stay runtime ints even when 1 (Triton would fold them into Python ints).
@triton.jit(do_not_specialize=["window", "num_reqs", "num_slots"])
def _chain_layout_kernel(
    tables_ptr, capacity_ptr, num_spec_ptr, slots_ptr, seq_len_ptr, accepted_ptr, emitted_ptr,
    pos_ptr, slot_mapping_ptr, seq_lens_ptr, qsl_ptr, bt_ptr, tokens_ptr, draft_at_ptr, rows_ptr, used_ptr,
    stride_emitted, window, num_reqs, num_slots,
    PASSES: tl.constexpr, MAX_BLOCKS: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_MB: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n = tl.load(seq_len_ptr + b).to(tl.int64)
    a = tl.load(accepted_ptr + b).to(tl.int64)
    q = window + p
    first = n - 1 - p
    reaches = tl.load(num_spec_ptr + slot) > p
    limit = tl.where(reaches, q, 0)
    group_slot = (1 + p).to(tl.int64) * num_slots + slot  # module p's KV group is 1 + p
    table_row = tables_ptr + group_slot * MAX_BLOCKS
    capacity = tl.load(capacity_ptr + group_slot)

    # The pass's rows: as window_metadata, at this pass's offset in the flat buffers.
    j = tl.arange(0, BLOCK_Q)
    in_window = j < q
    pos = first + j
    col = tl.minimum(tl.maximum(pos // PAGE, 0), MAX_BLOCKS - 1)
    block = tl.load(table_row + col, mask=in_window, other=0).to(tl.int64)
    owned = (j < limit) & (pos < capacity)
    out = num_reqs * (p * window + p * (p - 1) // 2) + b * q + j
    tl.store(pos_ptr + out, pos, mask=in_window)
    tl.store(slot_mapping_ptr + out, tl.where(owned, block * PAGE + pos % PAGE, -1), mask=in_window)
    pb = p * num_reqs + b  # index into the [P, B] outputs
    tl.store(seq_lens_ptr + pb, first + q)  # stores cast to the int32 output
    tl.store(qsl_ptr + p * (num_reqs + 1) + b, b * q)
    if b == 0:
        tl.store(qsl_ptr + p * (num_reqs + 1) + num_reqs, num_reqs * q)
    for c in range(0, MAX_BLOCKS, BLOCK_MB):  # the request's block table row in this group
        cols = c + tl.arange(0, BLOCK_MB)
        keep = cols < MAX_BLOCKS
        tl.store(bt_ptr + pb.to(tl.int64) * MAX_BLOCKS + cols, tl.load(table_row + cols, mask=keep), mask=keep)

    tl.store(draft_at_ptr + pb, b * (window + PASSES) + a + p + 1)
    tl.store(rows_ptr + 2 * p * num_reqs + b, b * q + a + p)
    tl.store(rows_ptr + (2 * p + 1) * num_reqs + b, b * q + a)
    tl.store(used_ptr + pb, reaches.to(tl.int8))
    if p == 0:
        t = tl.arange(0, BLOCK_T)
        tokens = tl.load(emitted_ptr + b * stride_emitted + t, mask=t < window, other=0)
        tl.store(tokens_ptr + b * (window + PASSES) + t, tokens, mask=t < window + PASSES)


def chain_layout(
    tables: torch.Tensor,  # [G, S, MB] int32, contiguous: every KV group's table per slot (module p's is 1 + p)
    capacity: torch.Tensor,  # [G, S] int64, contiguous
    num_spec: torch.Tensor,  # [S] int64
    slots: torch.Tensor,  # [B] int64
    seq_len: torch.Tensor,  # [B] int64: verified tokens before the step
    accepted: torch.Tensor,  # [B] int64
    emitted: torch.Tensor,  # [B, window] int64
    passes: int,
    block_size: int,
) -> ChainLayout:
    """See chain_layout_ref. Slots are not bounds-checked (that would need a device sync)."""
    groups, num_slots, max_blocks = tables.shape
    (batch, window), dev = emitted.shape, slots.device
    emitted = emitted if emitted.stride(1) == 1 else emitted.contiguous()
    # The kernel reads the per-request vectors at unit stride. A drafter rank gets `accepted` as a column of the
    # target's packed result (stride 1 + window): read as it was, rows past the first took tokens for accepted
    # counts, and module 0's read-back gathered out of bounds on two H200s (benchmarks/RESULTS.md, run 136).
    slots, seq_len, accepted = (t.contiguous() for t in (slots, seq_len, accepted))
    if not (tables.is_contiguous() and capacity.is_contiguous() and capacity.shape == (groups, num_slots)):
        raise ValueError(f"tables {tuple(tables.shape)} and capacity {tuple(capacity.shape)} must be contiguous "
                         "[groups, slots, ...] of the same groups and slots")
    if not 1 <= passes < groups:
        raise ValueError(f"passes {passes} must lie in 1 .. {groups - 1} (the module groups)")
    if not (slots.shape == seq_len.shape == accepted.shape == (batch,)):
        raise ValueError(f"slots {tuple(slots.shape)}, seq_len {tuple(seq_len.shape)} and accepted "
                         f"{tuple(accepted.shape)} must all be [{batch}] (emitted's rows)")
    rows_total = batch * (passes * window + passes * (passes - 1) // 2)
    i64 = dict(dtype=torch.int64, device=dev)
    lay = ChainLayout(
        window=window, positions=torch.empty(rows_total, **i64), slot_mapping=torch.empty(rows_total, **i64),
        seq_lens=torch.empty(passes, batch, dtype=torch.int32, device=dev),
        query_start_loc=torch.empty(passes, batch + 1, dtype=torch.int32, device=dev),
        block_tables=torch.empty(passes, batch, max_blocks, dtype=torch.int32, device=dev),
        tokens=torch.empty(batch, window + passes, **i64), draft_at=torch.empty(passes, batch, **i64),
        rows=torch.empty(passes, 2, batch, **i64), used=torch.empty(passes, batch, dtype=torch.bool, device=dev))
    if batch == 0:
        lay.query_start_loc.zero_()
        return lay
    _chain_layout_kernel[(batch, passes)](
        tables, capacity, num_spec, slots, seq_len, accepted, emitted,
        lay.positions, lay.slot_mapping, lay.seq_lens, lay.query_start_loc, lay.block_tables, lay.tokens,
        lay.draft_at, lay.rows, lay.used.view(torch.int8),
        emitted.stride(0), window, batch, num_slots,
        PASSES=passes, MAX_BLOCKS=max_blocks, PAGE=block_size, BLOCK_Q=triton.next_power_of_2(window + passes - 1),
        BLOCK_MB=min(triton.next_power_of_2(max_blocks), 256), BLOCK_T=triton.next_power_of_2(window + passes),
        num_warps=1,
    )
    return lay
