"""state_scatter: the one-launch diff scatter against state_scatter_ref (interpreted on CPU, compiled on CUDA
where a GPU exists, see conftest.py): every section alone and together, empty sections, more entries than
one program takes, float values through their float64 bits, and the state left untouched elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpserve.kernels.state_scatter_ref import state_scatter_ref


def _state(device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 1000, (3, 9, 40), generator=gen, dtype=torch.int32)
    capacity = torch.randint(0, 1000, (3, 9), generator=gen, dtype=torch.int64)
    ints = torch.randint(-2**62, 2**62, (5, 9), generator=gen, dtype=torch.int64)
    floats = torch.randn(7, 9, generator=gen)
    return tuple(t.to(device) for t in (tables, capacity, ints, floats))


def _packed(counts: tuple[int, int, int, int], sizes: list[int], seed: int) -> np.ndarray:
    """Per section n unique flat indices then n values (floats as float64 bits), as StateDiffs.pack lays them."""
    rng, parts = np.random.default_rng(seed), []
    for n, size, is_float in zip(counts, sizes, (False, False, False, True)):
        idx = rng.choice(size, n, replace=False).astype(np.int64)
        val = rng.normal(size=n).astype(np.float64).view(np.int64) if is_float else rng.integers(0, 2**40, n)
        parts += [idx, val.astype(np.int64)]
    return np.concatenate(parts)


@pytest.mark.parametrize("counts", [(1, 1, 0, 0), (0, 0, 0, 3), (5, 2, 4, 7), (300, 27, 45, 63), (0, 0, 0, 0)],
                         ids=["a-block", "floats-only", "every-section", "more-than-a-program", "nothing"])
def test_matches_the_reference(kernels, counts):
    from mtpserve.kernels.state_scatter import state_scatter

    want, got = _state(torch.device("cpu"), seed=sum(counts)), _state(kernels.device, seed=sum(counts))
    packed = _packed(counts, [t.numel() for t in want], seed=len(counts) + sum(counts))
    before = [t.clone() for t in want]
    state_scatter_ref(torch.from_numpy(packed), counts, *want)
    state_scatter(torch.from_numpy(packed).to(kernels.device), counts, *got)
    for w, g, b in zip(want, got, before):
        assert torch.equal(w, g.cpu())
    assert sum(int((w != b).sum()) for w, b in zip(want, before)) > 0 or not any(counts)


def test_refuses_state_of_another_layout(kernels):
    from mtpserve.kernels.state_scatter import state_scatter

    tables, capacity, ints, floats = _state(kernels.device, seed=0)
    packed = torch.from_numpy(_packed((1, 0, 0, 0), [tables.numel(), 1, 1, 1], seed=0)).to(kernels.device)
    with pytest.raises(ValueError, match="expected contiguous torch.int32"):
        state_scatter(packed, (1, 0, 0, 0), tables.long(), capacity, ints, floats)
