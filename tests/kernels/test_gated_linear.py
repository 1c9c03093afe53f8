"""gated_linear: the down projection with the SwiGLU activation folded in takes the route its measurement says
(the gated kernel, or silu_mul and the plain product), gives the two kernels' bits where it folds, keeps the
input's leading shape, and on CUDA is measured once, outside captures, against the two kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpserve.kernels import gated_linear
from mtpserve.kernels import linear_dispatch as dispatch
from mtpserve.kernels.silu_mul_ref import silu_mul_ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CONFIG = (32, 32, 2, 4, 1)  # a split config: the gated tiles through partials and the summing kernel


@pytest.fixture(autouse=True)
def fresh_dispatch(tmp_path, monkeypatch):
    """An empty table, mode auto and a cache of the test's own; the dispatch as it was afterwards."""
    saved_mode, saved = dispatch.mode(), dispatch.table()
    dispatch._table.clear()
    dispatch.set_mode("auto")
    monkeypatch.setenv("MTPSERVE_SKINNY_CACHE", str(tmp_path / "skinny.json"))
    monkeypatch.setattr(dispatch, "_cache_loaded", True)
    yield
    dispatch.set_mode(saved_mode)
    dispatch._table.clear()
    dispatch._table.update(saved)


def operands(device: torch.device, k: int = 64, n: int = 48):
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(3, 2, 2 * k, generator=gen).to(torch.bfloat16)  # [B, S, 2I]: rows of any leading shape
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return gate_up.to(device), w.to(device), b.to(device)


def test_the_measured_route_is_taken(kernels, monkeypatch):
    from mtpserve.kernels import skinny_gemm as sg
    from mtpserve.kernels.silu_mul import silu_mul

    monkeypatch.setattr(dispatch, "device_name", lambda device: "GPU X")
    monkeypatch.setattr(gated_linear, "_eligible", lambda flat, weight: True)  # a CPU tensor under the interpreter
    gated_calls = []
    plain = sg.skinny_gemm

    def recording(*args, **kwargs):
        gated_calls.append(kwargs.get("gated", False))
        return plain(*args, **kwargs)

    monkeypatch.setattr(sg, "skinny_gemm", recording)
    gate_up, w, b = operands(kernels.device)
    flat = gate_up.reshape(6, -1)
    key = dispatch.shape_key("GPU X", torch.bfloat16, 16, 48, 64) + gated_linear.SUFFIX

    dispatch.record(key, dispatch.Choice(CONFIG, 1.0, 2.0))  # the gated kernel measured faster
    out = gated_linear.linear_gated(gate_up, w, b)
    assert gated_calls == [True] and out.shape == (3, 2, 48)
    assert torch.equal(out.reshape(6, 48), plain(silu_mul(flat), w, b, sg.SkinnyConfig(*CONFIG)))

    for slower in (dispatch.Choice(CONFIG, 3.0, 2.0), dispatch.Choice((), float("inf"), 0.0)):  # slower; no memory
        gated_calls.clear()
        dispatch.record(key, slower)
        out = gated_linear.linear_gated(gate_up, w, b)
        assert True not in gated_calls
        assert torch.equal(out.reshape(6, 48), dispatch.linear(silu_mul(flat), w, b))


def test_off_ineligible_inputs_take_the_two_kernels(monkeypatch):
    gate_up, w, _ = operands(torch.device("cpu"))
    flat = gate_up.reshape(6, -1)
    assert not gated_linear._eligible(flat, w)  # on the CPU
    monkeypatch.setenv("MTPSERVE_SKINNY_GATED", "off")
    assert not gated_linear.enabled()
    monkeypatch.delenv("MTPSERVE_SKINNY_GATED")
    assert gated_linear.enabled()


@cuda
def test_a_cuda_product_is_measured_once_outside_captures_and_matches_the_reference(monkeypatch):
    from mtpserve.kernels.skinny_gemm import m_bucket

    gate_up, w, b = operands(torch.device("cuda"), k=512, n=768)
    layer = dispatch.DispatchedLinear(512, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    expected = F.linear(silu_mul_ref(gate_up.float()), w.float(), b.float())
    out = layer.forward_gated(gate_up)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    key = dispatch.shape_key(torch.cuda.get_device_name(), torch.bfloat16, m_bucket(6), 768, 512) + gated_linear.SUFFIX
    choice = dispatch.table()[key]
    assert choice.config and 0 < choice.skinny_us < float("inf") and choice.cublas_us > 0

    def no_measuring(*args, **kwargs):
        raise AssertionError("a measured shape is measured again")

    monkeypatch.setattr(gated_linear, "measure", no_measuring)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.forward_gated(gate_up)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out), "the graph runs the measured route: the same bits"
