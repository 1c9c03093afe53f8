"""Counter-based uniforms: the Triton kernel against the torch reference, bit for bit.

Seeds over the whole int64 range (negative ones included: the products wrap), token indices as the
engine makes them ([B] and a frontier broadcast against a window [B, k]), every stream. Interpreted on
CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.counter_uniforms_ref import counter_uniforms_ref
from mtpserve.workers.sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE


def _seeds(n: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([-(2**63), -1, 2**63 - 1])  # the edges of the range
    seeds[: min(n, 3)] = edges[: min(n, 3)]
    return seeds.to(device)


@pytest.mark.parametrize("stream", [STREAM_DRAFT, STREAM_ACCEPT, STREAM_SAMPLE])
@pytest.mark.parametrize("batch", [1, 7, 300])
def test_uniforms_equal_the_reference_bit_for_bit(kernels, batch, stream):
    from mtpserve.kernels.counter_uniforms import counter_uniforms

    seed = _seeds(batch, kernels.device)
    index = torch.randint(0, 1 << 20, (batch,), generator=torch.Generator().manual_seed(1)).to(kernels.device)
    out = counter_uniforms(seed, index, stream)
    assert out.dtype == torch.float32 and out.shape == (batch,)
    assert torch.equal(out, counter_uniforms_ref(seed, index, stream))
    assert bool(((out >= 0) & (out < 1)).all())


def test_a_window_of_indices_broadcasts_against_one_seed_per_row(kernels):
    """The verification's draws: seed [B, 1] against frontier + arange(k) [B, k]."""
    from mtpserve.kernels.counter_uniforms import counter_uniforms

    seed = _seeds(5, kernels.device)[:, None]
    index = torch.arange(40, 45, device=kernels.device)[:, None] + torch.arange(4, device=kernels.device)
    out = counter_uniforms(seed, index, STREAM_ACCEPT)
    assert out.shape == (5, 4) and torch.equal(out, counter_uniforms_ref(seed, index, STREAM_ACCEPT))
    assert out.unique().numel() == 20  # distinct draws per row and position


def test_empty_and_mistyped_inputs(kernels):
    from mtpserve.kernels.counter_uniforms import counter_uniforms

    empty = torch.zeros(0, dtype=torch.int64, device=kernels.device)
    assert counter_uniforms(empty, empty, STREAM_SAMPLE).shape == (0,)
    with pytest.raises(ValueError, match="int64"):
        counter_uniforms(empty.int(), empty, STREAM_SAMPLE)
