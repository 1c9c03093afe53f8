"""Async scheduling (docs/design.md §8): the engine launches decode step n+1 before it reads step n.

The host learns of a stop (EOS, stop id, stop string, max_tokens) one step late; the tokens computed
after it are dropped. Outputs must equal the synchronous engine's exactly, and every block must be
free at the end, also when requests are aborted while a step is in flight.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.block_manager import KVBlockManager
from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from tests.checkpoints import make_hf_checkpoint
from tests.conftest import prompts_of


@pytest.fixture(scope="module")
def worded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, a word-level tokenizer ("w3" .. "w96"), eos token 2, 3 MTP modules."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("worded"), vocab_size=97, num_mtp=3, tokenizer=True, seed=4)


def _params(i: int, stop_id: int | None = None, stop: str | None = None) -> SamplingParams:
    sampled = dict(temperature=0.9, top_p=0.95, seed=i) if i % 2 else dict(temperature=0.0)
    return SamplingParams(max_tokens=9 + 5 * i, ignore_eos=i % 3 != 0, stop_token_ids=[stop_id] if stop_id else [],
                          stop=[stop] if stop else [], **sampled)


def _generate(ckpt: Path, params: list[SamplingParams], overlap: bool, k: int, **engine_args) -> tuple[list, LLM]:
    # float32: greedy ties must break the same way whatever the batch composition (bf16 on a GPU may not).
    llm = LLM(str(ckpt), num_speculative_tokens=k, async_scheduling=overlap, dtype="float32", **engine_args)
    return llm.generate(prompts_of(97, [5, 8, 3, 12, 6, 9, 4][: len(params)], seed=2), params), llm


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_async_outputs_equal_synchronous_outputs(worded: Path, k: int) -> None:
    free, _ = _generate(worded, [_params(i) for i in range(7)], overlap=False, k=k)
    # Stops that end requests early, at tokens the free run produced: ids and strings.
    params = [_params(i, stop_id=free[i].token_ids[4] if i % 3 == 1 else None,
                      stop=free[i].text.split()[3] if i % 3 == 2 and len(free[i].text.split()) > 3 else None)
              for i in range(7)]
    sync, _ = _generate(worded, params, overlap=False, k=k)
    overlapped, llm = _generate(worded, params, overlap=True, k=k)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert [o.text for o in overlapped] == [o.text for o in sync]
    assert [o.finish_reason for o in overlapped] == [o.finish_reason for o in sync]
    assert any(o.finish_reason == "stop" for o in sync) and any(o.finish_reason == "length" for o in sync)
    assert llm.engine.num_overlapped_steps > 10
    assert llm.engine.blocks.all_free


def test_async_with_preemption_and_tight_budget(worded: Path) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for _ in range(7)]
    args = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24)
    sync, _ = _generate(worded, params, overlap=False, k=3, **args)
    overlapped, llm = _generate(worded, params, overlap=True, k=3, **args)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_overlapped_steps > 0
    assert llm.engine.blocks.all_free


def test_abort_while_a_step_is_in_flight(worded: Path) -> None:
    llm = LLM(str(worded), num_speculative_tokens=3, async_scheduling=True, dtype="float32")
    engine: LLMEngine = llm.engine
    prompts = prompts_of(97, [5, 8, 6], seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == 6:
            assert engine._in_flight is not None, "a step must be in flight when the abort comes"
            engine.abort_request("1")
    assert done["1"].finish_reason == "abort" and len(done["1"].token_ids) < 40
    alone = LLM(str(worded), num_speculative_tokens=3, dtype="float32").generate([prompts[0], prompts[2]], params)
    assert [done["0"].token_ids, done["2"].token_ids] == [o.token_ids for o in alone]
    assert engine.blocks.all_free


def test_finished_requests_are_freed_without_breaking_the_pipeline(worded: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that finished while the next step was in flight is freed by the plan launched after it,
    still overlapped: at high load requests finish nearly every step, and each drain would cost a step's
    worth of idle device."""
    params = [SamplingParams(max_tokens=9 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    sync, _ = _generate(worded, params, overlap=False, k=3)
    freeing: list[list[str]] = []
    llm = LLM(str(worded), num_speculative_tokens=3, async_scheduling=True, dtype="float32")
    plan_overlapped = llm.engine.scheduler.schedule_overlapped

    def spy(in_flight):
        plan = plan_overlapped(in_flight)
        if plan is not None and plan.freed_ids:
            freeing.append(plan.freed_ids)
        return plan

    monkeypatch.setattr(llm.engine.scheduler, "schedule_overlapped", spy)
    overlapped = llm.generate(prompts_of(97, [5, 8, 3, 12, 6, 9, 4], seed=2), params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert len(freeing) >= 4, freeing  # most of the 6 finishes before the last one
    assert llm.engine.blocks.all_free


def test_an_overlapped_plan_dropped_for_lack_of_blocks_allocates_none() -> None:
    """All or none: blocks taken for the first requests of a plan that is then dropped (a later one found no
    room) would sit in the scheduler's tables without the workers ever hearing of them, and the next plan,
    finding them there, would send none: the workers would write that KV elsewhere (outputs diverged under
    preemption with a tight KV budget)."""
    blocks = KVBlockManager(num_groups=2, num_blocks=4, block_size=4)
    assert blocks.allocate_all([("a", [8, 8]), ("b", [12, 4])]) is None  # b's target needs a fifth block
    assert blocks.tables == {} and all(pool.num_free == 4 for pool in blocks.pools)
    grown = blocks.allocate_all([("a", [8, 8]), ("b", [8, 4])])
    assert [[len(g) for g in per_request] for per_request in grown] == [[2, 2], [2, 1]]


def test_the_choosers_piece_of_a_due_choice_runs_after_the_launch_and_before_the_wait(
        worded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold, refit and cost parts ahead of a full choice (AdaptiveSpec.prepare_due) run once the step is launched:
    where the device is the slower, the host's wait for the step in flight takes them in. A step that launches none
    (the overlapped plan declined: a prefill due, a rise that rewinds) still runs them before its wait."""
    llm = LLM(str(worded), num_speculative_tokens="auto", async_scheduling=True, dtype="float32")
    engine, events = llm.engine, []
    submit, wait, prepare = engine.executor.submit, engine.executor.wait, AdaptiveSpec._prepare
    overlapped = engine._launch_overlapped

    def launch_overlapped() -> object:  # records a step whose overlapped plan was declined (it launches nothing)
        step = overlapped()
        if step is None:
            events.append("none launched")
        return step

    monkeypatch.setattr(engine.executor, "submit", lambda plan: (events.append("launch"), submit(plan))[1])
    monkeypatch.setattr(engine.executor, "wait", lambda handle: (events.append("wait"), wait(handle))[1])
    monkeypatch.setattr(engine, "_launch_overlapped", launch_overlapped)
    monkeypatch.setattr(AdaptiveSpec, "_prepare", lambda self, *a: (events.append("prepare"), prepare(self, *a))[1])
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(4)]
    llm.generate(prompts_of(97, [5, 8, 3, 12], seed=2), params)
    at = [i for i, e in enumerate(events) if e == "prepare"]
    assert len(at) >= 3
    assert all(events[i - 1] in ("launch", "none launched") and events[i + 1] == "wait" for i in at), events
