"""Prefill steps (mtpserve/workers/prefill_step.py, docs/design.md §8): prompt chunks at fixed shapes.

The general path is the reference (tested against transformers, teacher-forced replay and the exact
sampling distribution elsewhere). Both paths draw from the same counter-based random streams, so a
prefill step must emit the same tokens, logprobs and acceptance, token for token: for every sampling
setting, per-request k, both chain modes, chunked prompts (mid-prompt chunks, and chunks that leave
modules unaligned and so fall back to the general path), and padding to buckets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.boundary.messages import NewRequest, StepPlan
from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.prefill_graphs import row_buckets
from mtpserve.workers.prefill_step import PrefillShape
from mtpserve.workers.slot_state import SamplingFlags
from mtpserve.workers.state import CachedRequest
from tests.conftest import prompts_of
from tests.workers.test_uniform_step import SETTINGS, _params, _same, cuda, sync_errors

LENGTHS = [4, 9, 5, 14, 7, 11, 6, 20, 33, 2]
KS = [0, 1, 2, 3, 4, 3, 1, 4, 3, 2]  # per request: off, inside the module count, and recursing past it


def _llm(ckpt: Path, prefill: bool, pad: bool = False, device: str = "cpu", graphs: bool = False,
         **engine_args) -> LLM:
    llm = LLM(str(ckpt), device=device, dtype="float32", block_size=4, max_num_seqs=8, num_kv_blocks=400,
              cuda_graphs=graphs, prefill_step_rows=4096 if prefill else 0, **engine_args)
    runner: ModelRunner = llm.engine.executor.runner
    if runner.prefill is not None:
        runner.prefill.pad = pad or runner.prefill.use_graphs
    return llm


def _run(ckpt: Path, params: list[SamplingParams], prefill: bool, **args) -> tuple[list, ModelRunner]:
    llm = _llm(ckpt, prefill, **args)
    return llm.generate(prompts_of(64, LENGTHS[: len(params)], seed=11), params), llm.engine.executor.runner


@pytest.mark.parametrize("name", list(SETTINGS))
def test_prefill_steps_emit_what_the_general_path_emits(partly_trained: Path, name: str) -> None:
    params = _params(SETTINGS[name], KS, logprobs=True)
    general, off = _run(partly_trained, params, prefill=False)
    fixed, runner = _run(partly_trained, params, prefill=True)
    assert off.prefill is None and runner.prefill.runs >= 2, "the prompts must take prefill steps"
    _same(general, fixed)


@pytest.mark.parametrize("mode", ["depth", "recursive"])
@pytest.mark.parametrize("name", ["greedy", "top_p", "penalties"])
def test_chunked_prompts(partly_trained: Path, mode: str, name: str) -> None:
    # 6-token chunks: mid-prompt chunks (no sampling, modules advance), final chunks, and chunks ending
    # within a module's lag of the prompt's end, after which that module is unaligned (general path).
    params = _params(SETTINGS[name], KS)
    general, _ = _run(partly_trained, params, prefill=False, mtp_chain=mode, max_num_batched_tokens=6)
    llm = _llm(partly_trained, prefill=True, mtp_chain=mode, max_num_batched_tokens=6)
    runner: ModelRunner = llm.engine.executor.runner
    calls, inner = [], runner._run_general
    runner._run_general = lambda reqs, plan: calls.append(len(reqs)) or inner(reqs, plan)
    _same(general, llm.generate(prompts_of(64, LENGTHS, seed=11), params))
    assert runner.prefill.runs > 10
    # Only modules m >= 1 can be left unaligned (module 0 always commits a chunk's end): depth chains only.
    assert calls or mode == "recursive", "unaligned chunks must occur for this test to bite"


@pytest.mark.parametrize("mode", ["depth", "recursive"])
def test_padding_rows_change_nothing(partly_trained: Path, mode: str) -> None:
    params = _params(SETTINGS["penalties"], KS)
    general, _ = _run(partly_trained, params, prefill=False, mtp_chain=mode, max_num_batched_tokens=16)
    padded, runner = _run(partly_trained, params, prefill=True, pad=True, mtp_chain=mode, max_num_batched_tokens=16)
    assert runner.prefill.runs > 3
    _same(general, padded)
    state = runner.prefill.state
    assert int(state.capacity[:, state.pad_slot].max()) == 0, "the pad slot owns no KV"


def _request(num_computed: int, mtp_computed: list[int], forced: int | None = None) -> CachedRequest:
    new = NewRequest("r", list(range(1, 41)), 40, SamplingParams(), 3, 0, [[]] * 4, resume_token=forced)
    req = CachedRequest.from_new(new, 0, 3)
    req.num_computed, req.mtp_computed = num_computed, list(mtp_computed)
    return req


def test_only_aligned_chunks_take_prefill_steps(partly_trained: Path) -> None:
    runner: ModelRunner = LLM(str(partly_trained), num_speculative_tokens=3).engine.executor.runner
    takes = runner.prefill.takes
    def plan(rows: int, drafts: int = 0) -> StepPlan:
        return StepPlan(req_ids=["r"], num_tokens=[rows], num_drafts=[drafts])

    assert takes([_request(16, [16, 16, 16])], plan(8)) == [True]
    assert takes([_request(16, [16, 15, 16])], plan(8)) == [False], "module 1 lags: the general path catches it up"
    assert takes([_request(16, [16, 16, 16], forced=7)], plan(8)) == [False], "a resumed request's token is forced"
    assert takes([_request(16, [16, 16, 16])], plan(1, drafts=2)) == [False], "drafts to verify"
    runner.prefill.pad, runner.prefill.buckets = True, (16, 32)
    assert takes([_request(16, [16, 16, 16])], plan(24)) == [True]
    assert takes([_request(16, [16, 16, 16])], plan(33)) == [False], "more rows than the largest bucket"


def test_row_buckets() -> None:
    assert row_buckets(4096) == (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert row_buckets(100) == (16, 32, 64, 100) and row_buckets(16) == (16,)


def test_prefill_steps_can_be_turned_off(partly_trained: Path) -> None:
    assert LLM(str(partly_trained), prefill_step_rows=0).engine.executor.runner.prefill is None
    with pytest.raises(ValueError, match="prefill_step_rows"):
        LLM(str(partly_trained), prefill_step_rows=-1)


@cuda
@pytest.mark.parametrize("name", ["greedy", "top_p", "penalties"])
def test_prefill_graphs_equal_eager_on_cuda(partly_trained: Path, name: str) -> None:
    params = _params(SETTINGS[name], KS)
    eager, _ = _run(partly_trained, params, prefill=True, device="cuda", max_num_batched_tokens=16)
    graphed, runner = _run(partly_trained, params, prefill=True, device="cuda", graphs=True, max_num_batched_tokens=16)
    assert runner.prefill.replays > 3
    _same(eager, graphed)


@cuda
def test_a_captured_prefill_step_makes_no_host_sync(partly_trained: Path) -> None:
    llm = LLM(str(partly_trained), device="cuda", dtype="float32", num_speculative_tokens=3, max_num_seqs=8)
    runner: ModelRunner = llm.engine.executor.runner
    prompts = prompts_of(64, [6, 9], seed=1)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9))  # captures
    inner, checked = runner.prefill.run, []

    def strict(reqs, lens, diffs):
        checked.append(len(reqs))
        with sync_errors():
            return inner(reqs, lens, diffs)

    runner.prefill.run = strict
    llm.generate(prompts_of(64, [6, 9], seed=2), SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=3))
    assert checked and runner.prefill.replays >= 2


def test_an_all_padding_step_stays_inside_the_block_tables(partly_trained: Path) -> None:
    """What a capture runs: every row belongs to the padding owner, at positions up to the largest bucket.
    They must stay inside the pad slot's block table (on a GPU an overrun is an illegal memory access)."""
    prefill = _llm(partly_trained, prefill=True, pad=True).engine.executor.runner.prefill
    state = prefill.state
    assert prefill.buckets[-1] <= state.max_blocks * state.block_size
    shape = PrefillShape(prefill.buckets[-1], 3, SamplingFlags(all_greedy=False))
    head = torch.from_numpy(prefill._head([], [], prefill.entries, shape))
    before = [p.k.clone() for p in prefill.step.kv.target]
    out, raw = prefill.step(prefill._inputs(head, prefill.entries, shape), shape)
    assert out.shape == (prefill.entries, 2) and torch.isfinite(raw).all()
    assert all(torch.equal(a, p.k) for a, p in zip(before, prefill.step.kv.target)), "padding wrote KV"
