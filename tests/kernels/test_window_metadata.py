"""window_metadata: the Triton kernel against the torch reference, and the reference against a naive loop.

Interpreted on CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.window_metadata_ref import window_metadata_ref

PAGE, MAX_BLOCKS, SLOTS = 4, 5, 6


def _case(seed: int, batch: int) -> tuple[torch.Tensor, ...]:
    """Random tables and capacities; windows at random positions, some past the owned blocks or the table."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 50, (SLOTS, MAX_BLOCKS), generator=gen, dtype=torch.int32)
    capacity = torch.randint(0, MAX_BLOCKS * PAGE + 1, (SLOTS,), generator=gen)
    slots = torch.randint(0, SLOTS, (batch,), generator=gen)
    first_pos = torch.randint(0, MAX_BLOCKS * PAGE + 3, (batch,), generator=gen)
    limit = torch.randint(0, 7, (batch,), generator=gen)
    return tables, capacity, slots, first_pos, limit


def _naive(tables, capacity, slots, first_pos, limit, q, page):
    pos, slot_mapping = [], []
    for s, f, lim in zip(slots.tolist(), first_pos.tolist(), limit.tolist()):
        for j in range(q):
            p = f + j
            block = int(tables[s, min(p // page, tables.shape[1] - 1)])
            pos.append(p)
            slot_mapping.append(block * page + p % page if j < lim and p < int(capacity[s]) else -1)
    return pos, slot_mapping


@pytest.mark.parametrize("q", [1, 3, 4, 9])
def test_reference_matches_a_loop(q):
    args = _case(q, batch=5)
    pos, slot_mapping, seq_lens, qsl = window_metadata_ref(*args, q, PAGE)
    want_pos, want_slots = _naive(*args, q, PAGE)
    assert pos.tolist() == want_pos and slot_mapping.tolist() == want_slots
    assert seq_lens.dtype == qsl.dtype == torch.int32
    assert seq_lens.tolist() == (args[3] + q).tolist() and qsl.tolist() == list(range(0, 6 * q, q))


@pytest.mark.parametrize("q,batch", [(1, 1), (2, 7), (5, 3), (9, 4)])
def test_kernel_matches_reference(kernels, q, batch):
    from mtpserve.kernels.window_metadata import window_metadata

    args = _case(100 + q * batch, batch)
    want = window_metadata_ref(*args, q, PAGE)
    got = window_metadata(*(a.to(kernels.device) for a in args), q, PAGE)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


def test_kernel_reads_one_group_of_a_stacked_table(kernels):
    """The state keeps [groups, slots, blocks]: a group's table is a strided view, as the runner passes it."""
    from mtpserve.kernels.window_metadata import window_metadata

    tables, capacity, slots, first_pos, limit = _case(7, 3)
    stacked = torch.stack((tables.flip(0), tables)).to(kernels.device)
    caps = torch.stack((capacity.flip(0), capacity)).to(kernels.device)
    got = window_metadata(stacked[1], caps[1], slots.to(kernels.device), first_pos.to(kernels.device),
                          limit.to(kernels.device), 4, PAGE)
    for w, g in zip(window_metadata_ref(tables, capacity, slots, first_pos, limit, 4, PAGE), got):
        assert torch.equal(g.cpu(), w)


def test_kernel_takes_an_empty_batch_and_rejects_mismatched_shapes(kernels):
    from mtpserve.kernels.window_metadata import window_metadata

    tables, capacity, slots, first_pos, limit = (a.to(kernels.device) for a in _case(3, 2))
    pos, slot_mapping, seq_lens, qsl = window_metadata(tables, capacity, slots[:0], first_pos[:0], limit[:0], 3, PAGE)
    assert pos.numel() == slot_mapping.numel() == seq_lens.numel() == 0 and qsl.tolist() == [0]
    with pytest.raises(ValueError, match="first_pos"):
        window_metadata(tables, capacity, slots, first_pos[:1], limit, 3, PAGE)
