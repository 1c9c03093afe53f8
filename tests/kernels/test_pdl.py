"""Programmatic dependent launch (mtpserve/kernels/pdl.py): off where it cannot run, and on a Hopper GPU a chain
of PDL kernels (a decoder MLP's shape: norm, GEMM with split-K, SwiGLU, GEMM, norm with residual; even and
ragged widths), eager and replayed in a CUDA graph with changing inputs, gives bit for bit what the same
kernels give launched plainly. The attention and q/k norm kernels launch with PDL in their own compiled
tests (tests/kernels/test_paged_attention*.py, test_qk_norm_rope_store.py), PDL being on by default there.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtpserve.kernels import pdl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by conftest.py before this module is imported


def test_pdl_is_off_on_the_cpu():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.skipif(not INTERPRET, reason="this process compiles the kernels: CPU runs, with TRITON_INTERPRET=1, "
                                          "check the interpreter")
def test_pdl_is_off_under_the_interpreter():
    """Interpreted kernels cannot run griddepcontrol, whatever device a tensor claims."""
    assert not pdl.enabled(torch.device("cuda"))


@pytest.fixture
def device() -> torch.device:
    """A GPU whose kernels launch with PDL (the test is skipped, saying why, where none does)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU path never launches with PDL: test_pdl_is_off_on_the_cpu)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0 or later")
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("this Triton's launcher has no launch_pdl option")
    return torch.device("cuda")


def test_pdl_can_be_turned_off(device):
    try:
        pdl.set_enabled(False)
        assert not pdl.enabled(device) and pdl.options(device) == {"PDL": False}
    finally:
        pdl.set_enabled(True)
    assert pdl.enabled(device) and pdl.options(device) == {"PDL": True, "launch_pdl": True}


def _mlp(x: torch.Tensor, res: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from mtpserve.kernels.rmsnorm import rms_norm
    from mtpserve.kernels.silu_mul import silu_mul
    from mtpserve.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

    h = rms_norm(x, w["norm"], 1e-6)
    gate_up = skinny_gemm(h, w["gate_up"], config=SkinnyConfig(64, 128, 4, 4, 4))  # split-K: partials + sum
    down = skinny_gemm(silu_mul(gate_up), w["down"])
    return rms_norm(down, w["norm"], 1e-6, residual=res)


@pytest.mark.parametrize("hidden, inter", [(1024, 2816), (1000, 1400)], ids=["even", "ragged"])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_pdl_chain_matches_plain_launches_in_a_graph(device, rows, hidden, inter):
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    w = {"norm": rand(hidden), "gate_up": rand(2 * inter, hidden) / 32, "down": rand(hidden, inter) / 64}
    inputs = [(rand(rows, hidden), rand(rows, hidden)) for _ in range(3)]
    try:
        pdl.set_enabled(False)
        plain = [_mlp(x, r, w) for x, r in inputs]
    finally:
        pdl.set_enabled(True)
    for (x, r), (out, summed) in zip(inputs, plain):  # eager, PDL on
        got, got_sum = _mlp(x, r, w)
        assert torch.equal(got, out) and torch.equal(got_sum, summed)
    x_buf, r_buf = inputs[0][0].clone(), inputs[0][1].clone()
    _mlp(x_buf, r_buf, w)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf, sum_buf = _mlp(x_buf, r_buf, w)
    for (x, r), (out, summed) in zip(inputs, plain):
        x_buf.copy_(x)
        r_buf.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_buf, out) and torch.equal(sum_buf, summed)
