"""grouped_gemm: the Triton kernel against the plain-torch reference, and the reference against a loop
over experts (interpreted on CPU; compiled on CUDA where a GPU exists, see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpserve.kernels.grouped_gemm_ref import grouped_gemm_ref


def make_case(counts: list[int], m: int, k: int, dtype: torch.dtype, seed: int, left_out: int = 0):
    """Rows grouped by `counts`, then `left_out` rows that belong to no expert here."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts) + left_out, k, generator=gen).to(dtype)
    weight = torch.randn(len(counts), m, k, generator=gen).to(dtype)
    offsets = F.pad(torch.cumsum(torch.tensor(counts), 0), (1, 0))
    return x, weight, offsets


CASES = {
    # Expert sizes straddling the row tile (32), empty experts at both ends and between.
    "fp32-uneven": dict(counts=[0, 5, 33, 0, 64, 1, 0], m=72, k=40, dtype=torch.float32),
    "fp32-one-expert": dict(counts=[17], m=16, k=16, dtype=torch.float32),
    "fp32-many-small": dict(counts=[1, 2, 3, 0, 2, 1, 4, 1, 0, 3, 2, 1, 1, 1, 2, 3, 1], m=24, k=48, dtype=torch.float32),
    "bf16": dict(counts=[9, 0, 40, 7], m=64, k=96, dtype=torch.bfloat16),
    "fp32-rows-left-out": dict(counts=[4, 0, 35], m=40, k=32, dtype=torch.float32, left_out=37),
}


def test_reference_matches_a_loop_over_experts():
    x, weight, offsets = make_case([3, 0, 7, 1], 12, 20, torch.float32, seed=0)
    expected = torch.cat([x[offsets[e]:offsets[e + 1]] @ weight[e].T for e in range(4)])
    torch.testing.assert_close(grouped_gemm_ref(x, weight, offsets), expected, rtol=1e-6, atol=1e-6)
    x, weight, offsets = make_case([3, 0, 7, 1], 12, 20, torch.float32, seed=0, left_out=5)
    out = grouped_gemm_ref(x, weight, offsets)
    expected = torch.cat([x[offsets[e]:offsets[e + 1]] @ weight[e].T for e in range(4)])
    torch.testing.assert_close(out[:11], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[11:], torch.zeros(5, 12)), "rows past offsets[E] come out zero"
    assert grouped_gemm_ref(x[:0], weight, torch.zeros(5, dtype=torch.long)).shape == (0, 12)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case):
    from mtpserve.kernels.grouped_gemm import grouped_gemm

    spec = CASES[case]
    x, weight, offsets = make_case(**spec, seed=list(CASES).index(case))
    expected = grouped_gemm_ref(x.float(), weight.float(), offsets)
    dev = kernels.device
    out = grouped_gemm(x.to(dev), weight.to(dev), offsets.to(dev)).cpu()
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert not out[int(offsets[-1]):].any(), "rows past offsets[E] come out zero"
    tol = 1e-5 if spec["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_kernel_no_rows(kernels):
    from mtpserve.kernels.grouped_gemm import grouped_gemm

    x, weight, offsets = make_case([0, 0, 0], 8, 16, torch.float32, seed=1)
    assert grouped_gemm(x.to(kernels.device), weight.to(kernels.device), offsets.to(kernels.device)).shape == (0, 8)


@torch.no_grad()
def test_moe_experts_through_the_kernel_equal_the_reference_path(kernels, monkeypatch):
    """The routed-expert block (sort by expert, gate/up GEMM, SwiGLU, down GEMM, weighted sum back) with
    the kernel in place of the reference."""
    from mtpserve.kernels.grouped_gemm import grouped_gemm
    from mtpserve.workers.models import moe as moe_mod
    from mtpserve.workers.models.config import MoEConfig

    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=24, num_shared_experts=0, first_dense_layers=0)
    experts = moe_mod.Experts(32, cfg)
    gen = torch.Generator().manual_seed(3)
    for p in experts.parameters():
        p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    x = torch.randn(45, 32, generator=gen)
    weights = torch.rand(45, 2, generator=gen)
    chosen = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(45)])
    expected = experts(x, weights, chosen)
    monkeypatch.setattr(moe_mod, "_grouped_gemm", lambda _: grouped_gemm)
    dev = kernels.device
    out = experts.to(dev)(x.to(dev), weights.to(dev), chosen.to(dev)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
