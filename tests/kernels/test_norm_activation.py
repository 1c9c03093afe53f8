"""RMSNorm (with and without the fused residual add) and the SwiGLU activation: Triton against torch.

Rows of odd widths, strided views as the model produces them (q/k heads sliced out of a fused QKV
output, gate/up halves of one projection), fp32 to 1e-6 and bf16 to a unit or two in the last place
(the interpreter rounds fp32 -> bf16 differently from the GPU). Interpreted on CPU, compiled on CUDA
where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.rmsnorm_ref import rms_norm_ref
from mtpserve.kernels.silu_mul_ref import silu_mul_ref

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}  # bf16: one or two units in the last place


def _rand(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 3).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [64, 100, 1024])
def test_rms_norm_matches_reference(kernels, width, dtype):
    from mtpserve.kernels.rmsnorm import rms_norm

    x = _rand(7, width, dtype=dtype, device=kernels.device, seed=width)
    w = _rand(width, dtype=dtype, device=kernels.device, seed=1)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_fused_residual_returns_the_sum(kernels, dtype):
    from mtpserve.kernels.rmsnorm import rms_norm

    x = _rand(5, 96, dtype=dtype, device=kernels.device, seed=2)
    res = _rand(5, 96, dtype=dtype, device=kernels.device, seed=3)
    w = _rand(96, dtype=dtype, device=kernels.device, seed=4)
    out, summed = rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_sum = rms_norm_ref(x, w, 1e-5, residual=res)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(summed, ref_sum, atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_of_heads_sliced_from_a_fused_projection(kernels, dtype):
    """q/k norm: per-head rows of a strided [T, heads, D] view; the input is left untouched."""
    from mtpserve.kernels.rmsnorm import rms_norm

    heads, kv_heads, head_dim = 6, 2, 32
    qkv = _rand(9, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=kernels.device, seed=5)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(9, kv_heads, head_dim)
    before = qkv.clone()
    w = _rand(head_dim, dtype=dtype, device=kernels.device, seed=6)
    out = rms_norm(k, w, 1e-6)
    assert torch.equal(qkv, before) and out.shape == k.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, rms_norm_ref(k, w, 1e-6), atol=tol, rtol=tol)


def test_rms_norm_rejects_a_weight_of_another_width(kernels):
    from mtpserve.kernels.rmsnorm import rms_norm

    x = _rand(2, 64, dtype=torch.float32, device=kernels.device, seed=0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=kernels.device), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("inter", [100, 1536])
def test_silu_mul_matches_reference(kernels, inter, dtype):
    from mtpserve.kernels.silu_mul import silu_mul

    gate_up = _rand(6, 2 * inter, dtype=dtype, device=kernels.device, seed=inter)
    out = silu_mul(gate_up, block=256)  # several column tiles per row
    assert out.dtype == dtype and out.shape == (6, inter)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, silu_mul_ref(gate_up), atol=tol, rtol=tol)


def test_silu_mul_of_a_strided_view(kernels):
    from mtpserve.kernels.silu_mul import silu_mul

    wide = _rand(4, 300, dtype=torch.float32, device=kernels.device, seed=7)
    gate_up = wide[:, :200]  # row stride 300
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), atol=1e-6, rtol=1e-6)
