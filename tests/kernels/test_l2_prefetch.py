"""l2_prefetch: a hint, so what can be checked is where it is issued and that it changes nothing: nothing on the
CPU or when switched off, nothing for a tensor it cannot prefetch whole; on a Hopper GPU it compiles (both
variants), is captured into a CUDA graph, and the products after it give the same bits."""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels import l2_prefetch as prefetch

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper (sm_90) GPU: the bulk prefetch is its instruction")


def test_nothing_is_issued_on_the_cpu():
    assert not prefetch.l2_prefetch(torch.ones(1024))


@hopper
@pytest.mark.parametrize("variant", ["1", "last"])
def test_issued_eagerly_and_in_a_graph_changing_no_result(monkeypatch, variant):
    monkeypatch.setenv("MTPSERVE_L2_PREFETCH", variant)
    torch.manual_seed(0)
    w = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16)  # 8000 KiB: not a whole number of chunks
    x = torch.randn(8, 1000, device="cuda", dtype=torch.bfloat16)
    expected = x @ w.t()
    assert prefetch.l2_prefetch(w)
    assert torch.equal(x @ w.t(), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert prefetch.l2_prefetch(w)
        out = x @ w.t()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@hopper
def test_off_too_large_or_strided_tensors_are_left_alone(monkeypatch):
    w = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("MTPSERVE_L2_PREFETCH", "0")
    assert not prefetch.l2_prefetch(w)
    monkeypatch.setenv("MTPSERVE_L2_PREFETCH", "1")
    assert not prefetch.l2_prefetch(w.t())  # not contiguous: its bytes are not one range
    assert not prefetch.l2_prefetch(w[:0])
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    big = torch.empty(int(prefetch.MAX_L2_SHARE * l2) + 16, device="cuda", dtype=torch.uint8)
    assert not prefetch.l2_prefetch(big), "a tensor past the L2's share would evict itself"
    assert prefetch.l2_prefetch(big[: l2 // 4])
