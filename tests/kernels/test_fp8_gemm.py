"""fp8_linear: the Triton block-scaled FP8 kernel against the plain-torch reference, and the reference's
dequantisation against block arithmetic written here (interpreted on CPU; compiled on CUDA where a GPU
exists, see conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mtpserve.kernels.fp8_gemm_ref import dequantize_block_fp8, fp8_linear_ref


def make_case(n: int, m: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen).to(dtype)
    weight = (4 * torch.randn(m, k, generator=gen)).clamp(-440, 440).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(math.ceil(m / block[0]), math.ceil(k / block[1]), generator=gen) * 0.05 + 1e-3
    return x, weight, scale_inv


CASES = {
    "fp32-16x16-partial-blocks": dict(n=37, m=72, k=88, block=(16, 16), dtype=torch.float32),
    "fp32-128x128-decode-row": dict(n=1, m=300, k=260, block=(128, 128), dtype=torch.float32),
    "fp32-32x64": dict(n=20, m=96, k=192, block=(32, 64), dtype=torch.float32),
    "bf16-128x128": dict(n=9, m=256, k=384, block=(128, 128), dtype=torch.bfloat16),
}


def test_reference_dequantises_block_by_block():
    _, weight, scale_inv = make_case(1, 40, 50, (16, 32), torch.float32, seed=0)
    expected = torch.empty(40, 50)
    for i in range(40):
        for j in range(50):
            expected[i, j] = weight[i, j].float() * scale_inv[i // 16, j // 32]
    assert torch.equal(dequantize_block_fp8(weight, scale_inv, (16, 32)), expected)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case):
    from mtpserve.kernels.fp8_gemm import fp8_linear

    spec = dict(CASES[case])
    x, weight, scale_inv = make_case(**spec, seed=list(CASES).index(case))
    expected = fp8_linear_ref(x.float(), weight, scale_inv, spec["block"])
    dev = kernels.device
    out = fp8_linear(x.to(dev), weight.to(dev), scale_inv.to(dev), spec["block"]).cpu()
    assert out.dtype == x.dtype and out.shape == expected.shape
    tol = 1e-5 if spec["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_kernel_refuses_bad_blocks_and_dtypes(kernels):
    from mtpserve.kernels.fp8_gemm import fp8_linear

    x, weight, scale_inv = make_case(2, 32, 32, (16, 16), torch.float32, seed=1)
    dev = kernels.device
    with pytest.raises(ValueError, match="power of two"):
        fp8_linear(x.to(dev), weight.to(dev), torch.ones(1, 1, device=dev), (48, 48))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x.to(dev), weight.float().to(dev), scale_inv.to(dev), (16, 16))
    with pytest.raises(ValueError, match="disagree"):
        fp8_linear(x.to(dev), weight.to(dev), scale_inv[:1].to(dev), (16, 16))
