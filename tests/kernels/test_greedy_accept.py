"""greedy_accept: the Triton kernel against the torch reference, and the reference against a naive loop.

Interpreted on CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.greedy_accept_ref import greedy_accept_ref


def _case(seed: int, batch: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts that match the argmax with probability 3/4 each, so runs of every length occur."""
    gen = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, 5, (batch, k + 1), generator=gen)
    miss = torch.rand(batch, k, generator=gen) < 0.25
    drafts = torch.where(miss, argmax[:, :k] + 1, argmax[:, :k])
    return drafts, argmax, torch.randint(0, k + 1, (batch,), generator=gen)


def _naive(drafts, argmax, num_drafts) -> list[int]:
    out = []
    for d, a, n in zip(drafts.tolist(), argmax.tolist(), num_drafts.tolist()):
        run = 0
        while run < n and d[run] == a[run]:
            run += 1
        out.append(run)
    return out


@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_reference_matches_a_loop(k):
    args = _case(k, 64, k)
    assert greedy_accept_ref(*args).tolist() == _naive(*args)


@pytest.mark.parametrize("batch,k", [(1, 1), (7, 3), (33, 4), (5, 9)])
def test_kernel_matches_reference(kernels, batch, k):
    from mtpserve.kernels.greedy_accept import greedy_accept

    args = _case(batch * 10 + k, batch, k)
    got = greedy_accept(*(a.to(kernels.device) for a in args))
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), greedy_accept_ref(*args))


def test_kernel_takes_strided_rows_every_draft_accepted_and_empty_shapes(kernels):
    """The step passes window views ([:, 1:] of its input ids); a full run reads k."""
    from mtpserve.kernels.greedy_accept import greedy_accept

    dev = kernels.device
    argmax = torch.tensor([[4, 5, 6, 7], [1, 2, 3, 0]], device=dev)
    ids = torch.cat((torch.zeros(2, 1, dtype=torch.int64, device=dev), argmax[:, :3]), dim=1)
    assert greedy_accept(ids[:, 1:], argmax, torch.tensor([3, 2], device=dev)).tolist() == [3, 2]
    assert greedy_accept(ids[:, 1:1], argmax[:, :1], torch.tensor([0, 0], device=dev)).tolist() == [0, 0]
    with pytest.raises(ValueError, match="argmax"):
        greedy_accept(ids[:, 1:], argmax[:, :3], torch.tensor([3, 2], device=dev))
