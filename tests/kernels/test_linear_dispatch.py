"""linear_dispatch: cuBLAS unless measured slower; the DispatchedLinear module is nn.Linear to everything
else (state dict, isinstance); the table round-trips; measured choices persist between starts; on CUDA
the skinny path matches F.linear, a shape first seen inside a capture is not measured there, a
captured replay makes no host sync, and a second start takes the cached choice without measuring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.kernels import linear_dispatch as dispatch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fresh_dispatch(tmp_path, monkeypatch):
    """Each test starts from mode off, an empty table and a cache of its own (not yet read), and leaves the
    dispatch as it found it."""
    saved_mode, saved = dispatch.mode(), dispatch.table()
    dispatch._table.clear()
    dispatch.set_mode("off")
    monkeypatch.setenv("MTPSERVE_SKINNY_CACHE", str(tmp_path / "cache" / "skinny.json"))
    monkeypatch.setattr(dispatch, "_cache_loaded", False)
    monkeypatch.setattr(dispatch, "_cache_broken", False)
    yield
    dispatch.set_mode(saved_mode)
    dispatch._table.clear()
    dispatch._table.update(saved)


def test_auto_is_the_default_mode():
    env = {k: v for k, v in os.environ.items() if k != "MTPSERVE_SKINNY_GEMM"}
    code = "from mtpserve.kernels import linear_dispatch as d; print(d.mode())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "auto"


def test_dispatched_linear_is_an_nn_linear_with_the_same_state():
    torch.manual_seed(0)
    plain = nn.Linear(24, 40, bias=True)
    routed = dispatch.DispatchedLinear(24, 40, bias=True)
    assert isinstance(routed, nn.Linear) and routed.state_dict().keys() == plain.state_dict().keys()
    routed.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 24)
    for mode in dispatch.MODES:  # off CUDA every mode is F.linear
        dispatch.set_mode(mode)
        assert torch.equal(routed(x), plain(x))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        dispatch.set_mode("fast")


def test_table_round_trips_and_decides(tmp_path):
    key = dispatch.shape_key("GPU X", torch.bfloat16, 16, 4096, 4096)
    assert key == "GPU X|bfloat16|m16|n4096|k4096"
    wins = dispatch.Choice((64, 128, 2, 4, 4), 10.0, 12.0)
    loses = dispatch.Choice((64, 128, 1, 4, 4), 13.0, 12.0)
    path = tmp_path / "table.json"
    dispatch.save_table(path, {key: wins, key + "x": loses})
    dispatch._table.clear()
    assert dispatch.load_table(path) == 2
    assert dispatch.table() == {key: wins, key + "x": loses}
    assert wins.skinny_wins and not loses.skinny_wins


def test_the_route_is_the_fastest_of_three_with_cublas_kept_within_the_margin(tmp_path):
    """cuBLASLt is a third route: taken where it beats both cuBLAS (by WIN_MARGIN) and the skinny kernel; a table
    written before it was measured loads with it unmeasured (inf)."""
    lt = dispatch.Choice((64, 128, 2, 4, 4), 11.0, 12.0, 10.5)
    skinny = dispatch.Choice((64, 128, 2, 4, 4), 10.0, 12.0, 10.5)
    tie = dispatch.Choice((64, 128, 2, 4, 4), 13.0, 12.0, 11.9)  # within 2 % of cuBLAS: cuBLAS
    no_config = dispatch.Choice((), float("inf"), 12.0, 11.0)  # no skinny config fits, cuBLASLt may still win
    assert [c.route for c in (lt, skinny, tie, no_config)] == [dispatch.CUBLASLT, "skinny", "cublas", dispatch.CUBLASLT]
    assert skinny.skinny_wins and not lt.skinny_wins
    path = tmp_path / "table.json"
    dispatch.save_table(path, {"lt": lt, "tie": tie})
    dispatch._table.clear()
    assert dispatch.load_table(path) == 2 and dispatch.table() == {"lt": lt, "tie": tie}
    old = {"version": 1, "entries": {"a": {"config": [64, 128, 2, 4, 4], "skinny_us": 10.0, "cublas_us": 12.0}}}
    path.write_text(json.dumps(old))
    dispatch._table.clear()
    dispatch.load_table(path)
    assert dispatch.table()["a"].cublaslt_us == float("inf") and dispatch.table()["a"].route == "skinny"


def test_with_cublaslt_off_a_measured_cublaslt_route_falls_back(monkeypatch):
    """With MTPSERVE_CUBLASLT=off (on by default), where cuBLASLt was measured fastest the next best route runs."""
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "GPU X")
    monkeypatch.setattr(dispatch, "_cache_loaded", True)
    x, w = torch.zeros(8, 64), torch.zeros(32, 64)
    key = dispatch.shape_key("GPU X", torch.float32, 16, 32, 64)
    dispatch.set_mode("auto")
    for choice, routed in ((dispatch.Choice((64, 128, 1, 4, 4), 11.0, 12.0, 10.0), (64, 128, 1, 4, 4)),
                           (dispatch.Choice((64, 128, 1, 4, 4), 13.0, 12.0, 10.0), None)):
        dispatch.record(key, choice)
        monkeypatch.setenv("MTPSERVE_CUBLASLT", "on")
        assert dispatch._route_for(x, w, None) == dispatch.CUBLASLT
        monkeypatch.setenv("MTPSERVE_CUBLASLT", "off")
        assert dispatch._route_for(x, w, None) == routed
        monkeypatch.delenv("MTPSERVE_CUBLASLT")
        assert dispatch._route_for(x, w, None) == dispatch.CUBLASLT


def test_measured_choices_persist_for_the_next_start(tmp_path):
    """What one start measured, the next one reads (without replacing an explicit table's entries); a cache of
    another revision is ignored, and a shape left to cuBLAS for want of memory is not kept."""
    measured = dispatch.Choice((64, 128, 2, 4, 4), 10.0, 12.0)
    no_memory = dispatch.Choice((), float("inf"), 0.0)
    dispatch.record("a", measured)
    dispatch.record("b", no_memory)
    dispatch._persist()
    path = dispatch.cache_path()
    assert json.loads(path.read_text())["revision"] == dispatch.cache_revision()

    dispatch._table.clear()
    explicit = dispatch.Choice((32, 256, 1, 4, 4), 9.0, 12.0)
    dispatch.record("a", explicit)  # MTPSERVE_SKINNY_TABLE's entries are loaded at import, before the cache
    dispatch._load_cache()
    assert dispatch.table() == {"a": explicit}
    dispatch._table.clear()
    dispatch._load_cache()
    assert dispatch.table() == {"a": measured}, "the next start reads what was measured, not the out-of-memory skip"

    dispatch._table.clear()
    dispatch.save_table(path, {"a": measured}, revision="another kernel")
    dispatch._load_cache()
    assert dispatch.table() == {}


@pytest.mark.parametrize("where", ["under a file", "a directory"])
def test_an_unwritable_cache_warns_once_and_serving_goes_on(tmp_path, monkeypatch, where):
    """A cache whose parent is a file cannot be written at all; one that is a directory is written beside it
    and then cannot replace it: neither leaves a half-written file behind."""
    blocker = tmp_path / "blocker"
    blocker.mkdir() if where == "a directory" else blocker.write_text("")
    cache = blocker / "skinny.json" if where == "under a file" else blocker
    monkeypatch.setenv("MTPSERVE_SKINNY_CACHE", str(cache))
    dispatch.record("a", dispatch.Choice((64, 128, 2, 4, 4), 10.0, 12.0))
    with pytest.warns(UserWarning, match="cannot write the skinny GEMM cache"):
        dispatch._persist()
    assert [p.name for p in tmp_path.iterdir()] == ["blocker"], "nothing half-written is left behind"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch._persist()  # not tried again


def test_an_empty_cache_path_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv("MTPSERVE_SKINNY_CACHE", "")
    assert dispatch.cache_path() is None
    dispatch.record("a", dispatch.Choice((64, 128, 2, 4, 4), 10.0, 12.0))
    dispatch._persist()
    dispatch._load_cache()  # nothing to read, nothing raised
    assert list(dispatch.table()) == ["a"]


@cuda
@pytest.mark.parametrize("rows", [1, 7, 32, 100])
def test_skinny_path_matches_f_linear_on_cuda(rows):
    from mtpserve.kernels.skinny_gemm import m_bucket

    torch.manual_seed(rows)
    layer = dispatch.DispatchedLinear(512, 768, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight)  # no bias: the variants the gemm benchmark compiles anyway
    dispatch.set_mode("on")
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    key = dispatch.shape_key(torch.cuda.get_device_name(), torch.bfloat16, m_bucket(rows), 768, 512)
    assert key in dispatch.table(), "the first eager call measured the shape"


@cuda
def test_a_second_start_takes_the_cached_choice_without_measuring(monkeypatch):
    from mtpserve.kernels.skinny_gemm import m_bucket

    torch.manual_seed(0)
    layer = dispatch.DispatchedLinear(512, 768, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    dispatch.set_mode("auto")
    first = layer(x)
    key = dispatch.shape_key(torch.cuda.get_device_name(), torch.bfloat16, m_bucket(8), 768, 512)
    chosen = dispatch.table()[key]
    dispatch._table.clear()  # a new process: an empty table, the cache not read yet
    monkeypatch.setattr(dispatch, "_cache_loaded", False)

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached shape is measured again")

    monkeypatch.setattr(dispatch, "measure", no_measuring)
    assert torch.equal(layer(x), first), "the same kernel and config: the same bits"
    assert dispatch.table()[key] == chosen


@cuda
def test_the_cublaslt_route_matches_f_linear_eagerly_and_in_a_graph_and_restores_the_library(monkeypatch):
    from mtpserve.kernels.skinny_gemm import m_bucket

    monkeypatch.setenv("MTPSERVE_CUBLASLT", "on")
    torch.manual_seed(0)
    layer = dispatch.DispatchedLinear(512, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(24, 512, device="cuda", dtype=torch.bfloat16)
    key = dispatch.shape_key(torch.cuda.get_device_name(), torch.bfloat16, m_bucket(24), 768, 512)
    dispatch.record(key, dispatch.Choice((64, 128, 1, 4, 4), 20.0, 12.0, 10.0))  # cuBLASLt measured fastest
    dispatch.set_mode("auto")
    before = torch.backends.cuda.preferred_blas_library()
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert torch.backends.cuda.preferred_blas_library() == before


@cuda
def test_capture_does_not_measure_and_replay_makes_no_sync():
    torch.manual_seed(0)
    layer = dispatch.DispatchedLinear(256, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    dispatch.set_mode("on")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # the warm-up the runners do: measures and compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    measured = dispatch.table()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        unseen = layer(x[:1].expand(40, -1).contiguous())  # a new M bucket inside the capture
    assert dispatch.table() == measured, "nothing is measured inside a capture"
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(unseen, F.linear(x[:1], layer.weight).expand(40, -1), rtol=2e-2, atol=2e-2)


def test_every_projection_of_target_and_modules_is_dispatched():
    """The hook is in place: each matmul of a Llama target + MTP stack goes through the dispatch."""
    from mtpserve.workers.models.config import ModelConfig
    from mtpserve.workers.models.decoder import TargetModel
    from mtpserve.workers.models.mtp import MTPStack

    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1})
    with torch.device("meta"):
        target = TargetModel(cfg)
        mtp = MTPStack(cfg, target.rotary)
    linears = [m for model in (target, mtp) for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 4 + 1 + 4 + 1  # per block qkv, o, gate_up, down; LM head; eh_proj
    assert all(type(m) is dispatch.DispatchedLinear for m in linears)
