"""The CPU product through a oneDNN-packed weight (mtpserve/kernels/cpu_linear.py) against F.linear."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from mtpserve.kernels import cpu_linear, linear_dispatch

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN (mkldnn) on the CPU")


@pytest.fixture(autouse=True)
def onednn_mode():
    cpu_linear.set_mode("onednn")
    yield
    cpu_linear.set_mode("onednn")


@pytest.mark.parametrize("rows", [1, 2, 4, 9, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1031, 257, generator=gen)  # odd sizes: no blocking happens to divide them
    b = torch.randn(1031, generator=gen) if bias else None
    x = torch.randn(rows, 257, generator=gen)
    assert cpu_linear.eligible(x, weight)
    torch.testing.assert_close(cpu_linear.linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_batched_and_strided_inputs() -> None:
    weight = torch.randn(1024, 256)
    x3 = torch.randn(3, 5, 256)
    torch.testing.assert_close(cpu_linear.linear(x3, weight), F.linear(x3, weight), rtol=1e-5, atol=1e-4)
    xt = torch.randn(256, 6).t()  # rows with a stride of 1, columns of 6
    torch.testing.assert_close(cpu_linear.linear(xt, weight), F.linear(xt, weight), rtol=1e-5, atol=1e-4)


def test_a_weight_changed_in_place_is_packed_again() -> None:
    weight = torch.randn(1024, 256)
    x = torch.randn(4, 256)
    first = cpu_linear.linear(x, weight)
    weight.mul_(2.0)
    torch.testing.assert_close(cpu_linear.linear(x, weight), 2.0 * first, rtol=1e-5, atol=1e-4)


def test_the_packed_copy_leaves_with_its_weight() -> None:
    weight = torch.randn(1024, 256)
    cpu_linear.linear(torch.randn(1, 256), weight)
    key = id(weight)
    assert key in cpu_linear._packed
    del weight
    gc.collect()
    assert key not in cpu_linear._packed


def test_which_products_take_it() -> None:
    big, small, x = torch.randn(1024, 256), torch.randn(256, 256), torch.randn(2, 256)
    assert cpu_linear.eligible(x, big)
    assert not cpu_linear.eligible(x, small)  # below MIN_PACKED_NUMEL: F.linear is faster
    assert not cpu_linear.eligible(x.double(), big.double())
    assert not cpu_linear.eligible(x.bfloat16(), big.bfloat16())
    assert not cpu_linear.eligible(x, torch.randn(256, 1024).t())  # a transposed view: F.linear handles strides
    trained = torch.nn.Parameter(big.clone())
    assert not cpu_linear.eligible(x, trained)  # autograd records it: F.linear
    with torch.no_grad():
        assert cpu_linear.eligible(x, trained)
    cpu_linear.set_mode("torch")
    assert not cpu_linear.eligible(x, big)
    with pytest.raises(ValueError, match="MTPSERVE_CPU_GEMM"):
        cpu_linear.set_mode("mkl")


def test_dispatched_linear_trains_and_serves() -> None:
    """The model's linears: gradients flow through F.linear in training, inference takes the packed weight."""
    lin = linear_dispatch.DispatchedLinear(256, 1024)
    x = torch.randn(3, 256, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, x.detach().sum(0).expand(1024, 256))
    with torch.no_grad():
        out = lin(x)
    assert id(lin.weight) in cpu_linear._packed
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
