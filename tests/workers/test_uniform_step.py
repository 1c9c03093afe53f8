"""The device-resident uniform step (mtpserve/workers/uniform_step.py, docs/design.md §8).

The general path (host-planned layouts, eager) is the reference: it is tested against transformers,
teacher-forced replay and the exact sampling distribution elsewhere. Both paths draw from the same
counter-based random streams, so with the same logits they emit the same tokens: the uniform path is
checked token for token against it, greedy and seeded, for every sampling setting, per-request k,
both chain modes, padding to batch buckets, and (on a GPU) CUDA-graph replay without host syncs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.step_costs import StepCosts
from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.slot_state import DeviceState, StateDiffs, _last_writes, window_rows
from tests.conftest import prompts_of

LENGTHS = [4, 9, 5, 14, 7, 11, 6, 20]
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.9),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=1.2, min_p=0.1),
    "penalties": dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5),
}


def _params(setting: dict, ks: list[int | None], logprobs: bool = False) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=14 + 3 * (i % 4), seed=50 + i, ignore_eos=True, num_speculative_tokens=k,
                           logprobs=2 if logprobs and i % 3 == 0 else None, **setting)
            for i, k in enumerate(ks)]


def _run(ckpt: Path, params: list[SamplingParams], uniform: bool, pad: bool = False, device: str = "cpu",
         graphs: bool = False, **engine_args) -> tuple[list, ModelRunner]:
    llm = LLM(str(ckpt), device=device, dtype="float32", block_size=4, max_num_seqs=8, num_kv_blocks=400,
              uniform_steps=uniform, cuda_graphs=graphs, **engine_args)
    runner: ModelRunner = llm.engine.executor.runner
    if runner.uniform is not None:
        runner.uniform.pad = pad or runner.uniform.use_graphs
    return llm.generate(prompts_of(64, LENGTHS[: len(params)], seed=11), params), runner


def _same(a: list, b: list) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accepted_per_step for o in a] == [o.accepted_per_step for o in b]
    for x, y in zip(a, b):
        if x.logprobs is not None:
            assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]
            assert np.allclose([v for d in x.logprobs for v in d.values()], [v for d in y.logprobs for v in d.values()],
                               atol=1e-4)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_uniform_steps_emit_what_the_general_path_emits(partly_trained: Path, name: str) -> None:
    ks = [0, 1, 2, 3, 4, 3, 1, 4]  # per request: off, inside the module count, and recursing past it
    params = _params(SETTINGS[name], ks, logprobs=True)
    general, _ = _run(partly_trained, params, uniform=False)
    uniform, runner = _run(partly_trained, params, uniform=True)
    assert runner.uniform.runs > 10, "most steps must take the uniform path for this test to bite"
    _same(general, uniform)


@pytest.mark.parametrize("mode", ["depth", "recursive"])
@pytest.mark.parametrize("name", ["greedy", "penalties"])
def test_padding_rows_change_nothing(partly_trained: Path, mode: str, name: str) -> None:
    params = _params(SETTINGS[name], [3, 2, 4, 1, 3])  # 5 requests, then fewer: buckets 8, 4, 2, 1
    general, _ = _run(partly_trained, params, uniform=False, mtp_chain=mode)
    padded, runner = _run(partly_trained, params, uniform=True, pad=True, mtp_chain=mode)
    assert runner.uniform.runs > 10
    _same(general, padded)
    state = runner.uniform.state
    assert int(state.capacity[:, state.pad_slot].max()) == 0, "the pad slot owns no KV"


def test_engine_default_takes_uniform_steps_for_decode(trained_ckpt: Path) -> None:
    engine = LLM(str(trained_ckpt), num_speculative_tokens=3).engine
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    # The prefill step is general; every later step is uniform.
    assert steps > 5 and engine.executor.runner.uniform.runs == steps - 1


def test_window_rows_drop_writes_past_the_limit_and_outside_owned_blocks() -> None:
    state = DeviceState(num_slots=2, num_groups=1, max_blocks=4, block_size=4, vocab=8, device=torch.device("cpu"))
    diffs = StateDiffs(2, 1, 4, 4)
    diffs.table(0, 1, [7, 3], 0)  # slot 1 owns blocks 7 and 3: positions 0..7
    packed, counts = diffs.pack(np.zeros(0, dtype=np.int64))
    state.apply(torch.from_numpy(packed), counts)
    slots = torch.tensor([1, state.pad_slot])
    meta, pos = window_rows(state, 0, slots, torch.tensor([5, 16]), 4, torch.tensor([3, 4]))
    assert pos.tolist() == [5, 6, 7, 8, 16, 17, 18, 19]
    # slot 1: row 3 (position 8) is past its blocks; the pad slot owns nothing
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, -1, -1, -1, -1, -1]
    assert meta.seq_lens.tolist() == [9, 20] and meta.query_start_loc.tolist() == [0, 4, 8]
    meta, _ = window_rows(state, 0, slots, torch.tensor([5, 16]), 4, torch.tensor([2, 4]))
    assert meta.slot_mapping.tolist()[:4] == [3 * 4 + 1, 3 * 4 + 2, -1, -1]  # rows past the limit write nothing


def test_state_diffs_keep_the_last_write_to_each_index() -> None:
    idx, val = _last_writes(np.array([[3, 1], [5, 2], [3, 7], [1, 4], [5, 9]]))
    assert idx.tolist() == [1, 3, 5] and val.tolist() == [4, 7, 9]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@contextlib.contextmanager
def sync_errors() -> Iterator[None]:
    """Any host-device synchronisation inside raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("name", ["greedy", "top_p", "penalties"])
def test_graphs_equal_eager_on_cuda(partly_trained: Path, k: int, name: str) -> None:
    params = _params(SETTINGS[name], [k] * 5)
    eager, _ = _run(partly_trained, params, uniform=True, device="cuda")
    graphed, runner = _run(partly_trained, params, uniform=True, device="cuda", graphs=True)
    assert runner.uniform.replays > 3
    _same(eager, graphed)


@cuda
def test_a_captured_step_makes_no_host_sync(partly_trained: Path) -> None:
    llm = LLM(str(partly_trained), device="cuda", dtype="float32", num_speculative_tokens=3, max_num_seqs=8)
    runner: ModelRunner = llm.engine.executor.runner
    llm.generate(prompts_of(64, [6, 9], seed=1), SamplingParams(max_tokens=8, temperature=0.0))  # captures
    engine = llm.engine
    for i, p in enumerate(prompts_of(64, [6, 9], seed=2)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=i))
    engine.step()  # the prefill (general path)
    inner = runner.uniform.run

    checked = []

    def strict(slots, num_drafts, shape, diffs):
        bucket = next(b for b in runner.uniform.buckets if b >= len(slots))
        if (bucket, shape) not in runner.uniform.graphs:  # capturing synchronises by design
            return inner(slots, num_drafts, shape, diffs)
        with sync_errors():
            out = inner(slots, num_drafts, shape, diffs)
        checked.append(shape)
        return out

    runner.uniform.run = strict
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 5



@cuda
def test_overlapped_decode_steps_feed_their_device_and_host_shares(partly_trained: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the engine overlaps decode steps and the runner times each on the device (design §9): the
    cost model gets both shares of every sampled lap."""
    shares: list[tuple[float, float, bool]] = []
    observe = StepCosts.observe
    monkeypatch.setattr(StepCosts, "observe", lambda self, batch, k, device, host, overlapped, tokens, greedy, lap: (
        shares.append((device, host, overlapped)), observe(self, batch, k, device, host, overlapped, tokens, greedy,
                                                           lap)))
    llm = LLM(str(partly_trained), device="cuda", dtype="float32", max_num_seqs=8)  # "auto" by default
    llm.generate(prompts_of(64, [6, 9, 7], seed=1), SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    assert len(shares) > 10
    device, host, overlapped = map(np.array, zip(*shares))
    assert overlapped.all() and (device > 0).all() and (host > 0).all()
    costs = llm.engine.adaptive.costs
    assert costs.overlapped and costs.host(3) > 0


@cuda
def test_the_default_ks_graphs_are_captured_at_start(partly_trained: Path) -> None:
    llm = LLM(str(partly_trained), device="cuda", dtype="float32", num_speculative_tokens=3, max_num_seqs=8)
    uniform = llm.engine.executor.runner.uniform
    at_start = set(uniform.graphs)
    assert {bucket for bucket, _ in at_start} == set(uniform.buckets)
    assert {(shape.window, shape.chain) for _, shape in at_start} == {(1, 0), (4, 3)}
    llm.generate(prompts_of(64, [6, 9, 7], seed=1), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert uniform.replays > 3
    # Even the last steps, which verify fewer drafts before max_tokens, replay the graphs captured at start.
    assert set(uniform.graphs) == at_start


@cuda
def test_both_sampling_modes_graphs_seed_their_step_costs(partly_trained: Path) -> None:
    """The graphs captured at start are timed in both modes (design §9): a sampled batch's drafts are priced
    from the sampled graphs, which cost the device more than the greedy ones."""
    llm = LLM(str(partly_trained), device="cuda", dtype="float32", max_num_seqs=8)  # "auto" by default
    modes = llm.engine.adaptive.costs.modes
    greedy, sampled = (~np.isnan(modes[g].seeds) for g in (True, False))
    assert greedy.any() and (greedy == sampled).all()
