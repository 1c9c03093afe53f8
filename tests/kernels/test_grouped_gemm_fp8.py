"""grouped_gemm_fp8: the Triton grouped GEMM over block-scaled FP8 experts against its plain-torch
reference, and the reference against per-expert block arithmetic (interpreted on CPU; compiled on CUDA
where a GPU exists, see conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mtpserve.kernels.fp8_gemm_ref import dequantize_block_fp8
from mtpserve.kernels.grouped_gemm_fp8_ref import dequantize_experts_fp8, grouped_gemm_fp8_ref
from mtpserve.kernels.grouped_gemm_ref import grouped_gemm_ref


def make_case(counts: list[int], m: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int,
              left_out: int = 0):
    """Rows grouped by `counts` (then `left_out` rows of no expert here), FP8 experts with block scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts) + left_out, k, generator=gen).to(dtype)
    weight = (4 * torch.randn(len(counts), m, k, generator=gen)).clamp(-440, 440).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(len(counts), math.ceil(m / block[0]), math.ceil(k / block[1]), generator=gen) * 0.05 + 1e-3
    offsets = F.pad(torch.cumsum(torch.tensor(counts), 0), (1, 0))
    return x, weight, scale_inv, offsets


CASES = {
    # Expert sizes straddling the row tile (32), empty experts, partial quantisation blocks on both sides.
    "fp32-uneven-16x16": dict(counts=[0, 5, 33, 0, 64, 1, 0], m=72, k=40, block=(16, 16), dtype=torch.float32),
    "fp32-128x128-decode": dict(counts=[1, 0, 1, 1, 0, 0, 1], m=300, k=260, block=(128, 128), dtype=torch.float32),
    "fp32-32x64-left-out": dict(counts=[4, 0, 35], m=40, k=192, block=(32, 64), dtype=torch.float32, left_out=9),
    "bf16-128x128": dict(counts=[9, 0, 40, 7], m=256, k=384, block=(128, 128), dtype=torch.bfloat16),
}


def test_reference_dequantises_each_expert_block_by_block():
    x, weight, scale_inv, offsets = make_case([3, 0, 7, 1], 40, 50, (16, 32), torch.float32, seed=0)
    deq = dequantize_experts_fp8(weight, scale_inv, (16, 32))
    for e in range(4):
        assert torch.equal(deq[e], dequantize_block_fp8(weight[e], scale_inv[e], (16, 32)))
    assert torch.equal(grouped_gemm_fp8_ref(x, weight, scale_inv, offsets, (16, 32)), grouped_gemm_ref(x, deq, offsets))


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case):
    from mtpserve.kernels.grouped_gemm import grouped_gemm_fp8

    spec = dict(CASES[case])
    x, weight, scale_inv, offsets = make_case(**spec, seed=list(CASES).index(case))
    expected = grouped_gemm_fp8_ref(x.float(), weight, scale_inv, offsets, spec["block"])
    dev = kernels.device
    out = grouped_gemm_fp8(x.to(dev), weight.to(dev), scale_inv.to(dev), offsets.to(dev), spec["block"]).cpu()
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert not out[int(offsets[-1]):].any(), "rows past offsets[E] come out zero"
    tol = 1e-5 if spec["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_kernel_no_rows_and_refusals(kernels):
    from mtpserve.kernels.grouped_gemm import grouped_gemm_fp8

    dev = kernels.device
    x, weight, scale_inv, offsets = (t.to(dev) for t in make_case([0, 0, 0], 32, 16, (16, 16), torch.float32, seed=1))
    assert grouped_gemm_fp8(x, weight, scale_inv, offsets, (16, 16)).shape == (0, 32)
    with pytest.raises(ValueError, match="power of two"):
        grouped_gemm_fp8(x, weight, torch.ones(3, 1, 1, device=dev), offsets, (48, 48))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        grouped_gemm_fp8(x, weight.float(), scale_inv, offsets, (16, 16))
    with pytest.raises(ValueError, match="disagree"):
        grouped_gemm_fp8(x, weight, scale_inv[:, :1], offsets, (16, 16))
