"""chain_layout: the Triton kernel against the torch reference, and the reference against a naive loop.

Interpreted on CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.chain_layout_ref import chain_layout_ref

PAGE, MAX_BLOCKS, SLOTS, GROUPS = 4, 5, 6, 4  # the target's group and three modules'


def _case(seed: int, batch: int, window: int) -> tuple[torch.Tensor, ...]:
    """Random tables and capacities; requests at random lengths, some past their owned blocks or the table."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 50, (GROUPS, SLOTS, MAX_BLOCKS), generator=gen, dtype=torch.int32)
    capacity = torch.randint(0, MAX_BLOCKS * PAGE + 1, (GROUPS, SLOTS), generator=gen)
    num_spec = torch.randint(0, GROUPS, (SLOTS,), generator=gen)
    slots = torch.randperm(SLOTS, generator=gen)[:batch]
    seq_len = torch.randint(GROUPS, MAX_BLOCKS * PAGE + 3, (batch,), generator=gen)
    accepted = torch.randint(0, window, (batch,), generator=gen)
    emitted = torch.randint(1, 100, (batch, window), generator=gen)
    return tables, capacity, num_spec, slots, seq_len, accepted, emitted


def _naive_pass(args, p: int) -> tuple[list[int], list[int], list[list[int]], list[int], list[int]]:
    """Pass p by hand: (positions, slot mapping, [drafting row, carry row] per request, block table rows, used)."""
    tables, capacity, num_spec, slots, seq_len, accepted, emitted = args
    window = emitted.shape[1]
    q = window + p
    pos, mapping, rows, used = [], [], [[], []], []
    for b, (s, n, a) in enumerate(zip(slots.tolist(), seq_len.tolist(), accepted.tolist())):
        reaches = int(num_spec[s]) > p
        used.append(reaches)
        rows[0].append(b * q + a + p)
        rows[1].append(b * q + a)
        for j in range(q):
            at = n - 1 - p + j
            block = int(tables[1 + p, s, min(at // PAGE, MAX_BLOCKS - 1)])
            pos.append(at)
            mapping.append(block * PAGE + at % PAGE if reaches and at < int(capacity[1 + p, s]) else -1)
    return pos, mapping, rows, used


@pytest.mark.parametrize("window,passes", [(1, 1), (4, 3), (2, 2)])
def test_reference_matches_a_loop(window, passes):
    args = _case(window * 10 + passes, batch=4, window=window)
    lay = chain_layout_ref(*args, passes, PAGE)
    tables, _, _, slots, seq_len, accepted, emitted = args
    for p in range(passes):
        pos, mapping, rows, used = _naive_pass(args, p)
        assert lay.positions[lay.span(p)].tolist() == pos and lay.slot_mapping[lay.span(p)].tolist() == mapping
        assert lay.rows[p].tolist() == rows and lay.used[p].tolist() == used
        assert torch.equal(lay.block_tables[p], tables[1 + p, slots])
        assert lay.seq_lens[p].tolist() == (seq_len - 1 + window).tolist()  # every pass ends at the same position
        assert lay.query_start_loc[p].tolist() == list(range(0, 5 * (window + p), window + p))
    width = window + passes
    assert lay.positions.numel() == sum(4 * (window + p) for p in range(passes))
    assert torch.equal(lay.tokens[:, :window], emitted) and not lay.tokens[:, window:].any()
    assert lay.draft_at.tolist() == [[b * width + a + p + 1 for b, a in enumerate(accepted.tolist())]
                                     for p in range(passes)]


@pytest.mark.parametrize("window,passes,batch", [(1, 1, 1), (4, 3, 5), (2, 3, 2), (9, 2, 3)])
def test_kernel_matches_reference(kernels, window, passes, batch):
    from mtpserve.kernels.chain_layout import chain_layout

    args = _case(100 + window * passes * batch, batch, window)
    want = chain_layout_ref(*args, passes, PAGE)
    got = chain_layout(*(a.to(kernels.device) for a in args), passes, PAGE)
    for name in ("positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables", "tokens", "draft_at",
                 "rows", "used"):
        w, g = getattr(want, name), getattr(got, name)
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), name


def test_kernel_reads_accepted_and_the_window_as_strided_views(kernels):
    """A drafter rank takes the accepted counts and the verified tokens as columns of the target's packed result
    [B, 1 + window]: neither is contiguous (the accepted counts read at unit stride gathered out of bounds on
    two H200s)."""
    from mtpserve.kernels.chain_layout import chain_layout

    tables, capacity, num_spec, slots, seq_len, accepted, emitted = _case(5, 3, 4)
    packed = torch.cat((accepted[:, None], emitted), dim=1).to(kernels.device)
    dev = kernels.device
    got = chain_layout(*(a.to(dev) for a in (tables, capacity, num_spec, slots, seq_len)), packed[:, 0],
                       packed[:, 1:], 2, PAGE)
    want = chain_layout_ref(tables, capacity, num_spec, slots, seq_len, accepted, emitted, 2, PAGE)
    for name in ("positions", "slot_mapping", "tokens", "draft_at", "rows", "used"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


def test_kernel_takes_an_empty_batch_and_rejects_bad_shapes(kernels):
    from mtpserve.kernels.chain_layout import chain_layout

    tables, capacity, num_spec, slots, seq_len, accepted, emitted = (a.to(kernels.device) for a in _case(3, 2, 2))
    lay = chain_layout(tables, capacity, num_spec, slots[:0], seq_len[:0], accepted[:0], emitted[:0], 2, PAGE)
    assert lay.positions.numel() == lay.rows.numel() == 0 and lay.query_start_loc.tolist() == [[0], [0]]
    with pytest.raises(ValueError, match="passes"):
        chain_layout(tables, capacity, num_spec, slots, seq_len, accepted, emitted, GROUPS, PAGE)
    with pytest.raises(ValueError, match="seq_len"):
        chain_layout(tables, capacity, num_spec, slots, seq_len[:1], accepted, emitted, 2, PAGE)
