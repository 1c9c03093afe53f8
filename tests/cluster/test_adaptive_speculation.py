"""Adaptive speculation end to end on CPU (docs/design.md §9): whatever k the engine chooses, step by step,
outputs are those without speculation (greedy) or have the target distribution (sampled), and every
committed MTP KV entry stays the teacher-forced one after k falls to 0 and rises again.

The chooser is forced through fixed schedules here (down to 0 and back up, in decode and in prefill), so
that every switch and catch-up happens in a few steps on a tiny model; test_spec_chooser.py tests what
it would choose.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.boundary.messages import StepPlan
from mtpserve.cluster.scheduler import Scheduler
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from tests.cluster.test_lossless_sampling import SAMPLES, SETTINGS, VOCAB, PROMPT, _exact_joint, small_vocab_ckpt  # noqa: F401
from tests.conftest import prompts_of
from tests.stats import ALPHA, chi_square_pvalue
from tests.workers.test_mtp_kv_invariant import _assert_pools_match, _teacher_forced_keys

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 2, 3, 5, 7, 9, 12, 15, 17, 20, 23, 26, 30, 33, 38, 41, 4, 11]
# Down to 0 and back up, one step at a time and in jumps, past the last module (4 = recursive step).
SCHEDULE = [3, 3, 0, 0, 1, 4, 2, 0, 0, 0, 3, 1, 4, 4, 0, 2]


def force_k(monkeypatch: pytest.MonkeyPatch, schedule: list[int]) -> None:
    """Every step's k comes from `schedule` (cycled) instead of the chooser."""
    ks = itertools.cycle(schedule)
    monkeypatch.setattr(AdaptiveSpec, "choose", lambda self, rows, batch=None, newcomers_adaptive=True: next(ks))


def test_auto_is_the_default_and_adaptive(partly_trained: Path) -> None:
    llm = LLM(str(partly_trained), block_size=4)
    r = llm.engine.resolved
    assert (r.default_auto, r.adaptive, r.max_auto_spec) == (True, True, 4)
    assert llm.engine.adaptive is not None


def test_greedy_auto_identical_to_no_speculation_and_to_fixed_k(partly_trained: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = prompts_of(64, LENGTHS, seed=3)
    # Chunked prefill and preemption as in test_speculative_engine (60 blocks of 4 cannot hold them all).
    engine = dict(block_size=4, num_kv_blocks=60, max_num_batched_tokens=32)
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0, **engine).generate(prompts, GREEDY)]
    fixed = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=3, **engine).generate(prompts, GREEDY)]
    assert fixed == expected
    chosen = LLM(str(partly_trained), **engine)  # the chooser's own choices
    assert [o.token_ids for o in chosen.generate(prompts, GREEDY)] == expected
    force_k(monkeypatch, SCHEDULE)
    llm = LLM(str(partly_trained), **engine)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.executor.runner.num_catch_ups > len(prompts)  # the lagging modules were caught up
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.blocks.all_free
    accepted = [a for o in outs for a in o.accepted_per_step]
    assert 0 < sum(accepted), "drafts must be accepted for the test to bite"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_mixed_batch_of_auto_fixed_and_off_requests(partly_trained: Path, monkeypatch: pytest.MonkeyPatch,
                                                    overlap: bool) -> None:
    """A fixed k and k = 0 stay what the request asked for, beside adaptive requests."""
    prompts = prompts_of(64, LENGTHS[:9], seed=5)
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0).generate(prompts, GREEDY)]
    force_k(monkeypatch, [0, 0, 4, 1, 1, 3])
    llm = LLM(str(partly_trained), block_size=4, async_scheduling=overlap)
    specs = ["auto", 2, 0]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, num_speculative_tokens=specs[i % 3])
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert not overlap or llm.engine.num_overlapped_steps > 0
    for i, o in enumerate(outs):
        if specs[i % 3] == 0:
            assert o.accepted_per_step == []
        if specs[i % 3] == 2:
            assert max(o.accepted_per_step) <= 2


def test_a_long_lag_is_not_caught_up(partly_trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past Scheduler.MAX_CATCH_UP lagged positions a request keeps the drafts its current modules give."""
    prompts = prompts_of(64, [5, 9, 14], seed=8)
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0).generate(prompts, GREEDY)]
    monkeypatch.setattr(Scheduler, "MAX_CATCH_UP", 2)
    force_k(monkeypatch, [3, 3] + [0] * 6 + [3] * 40)
    llm = LLM(str(partly_trained), block_size=4)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.executor.runner.num_catch_ups == 0
    assert all(len(o.accepted_per_step) <= 2 for o in outs)  # drafts verified only after the first two steps


def test_a_long_prompt_prefilled_at_k0_still_speculates(trained_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than MAX_CATCH_UP runs every module while more than that is left to prefill, whatever
    the step's k: otherwise its modules would lag from position 0 for good and it would never speculate."""
    prompts = prompts_of(64, [20, 29, 37], seed=9)
    expected = [o.token_ids for o in LLM(str(trained_ckpt), num_speculative_tokens=0).generate(prompts, GREEDY)]
    monkeypatch.setattr(Scheduler, "MAX_CATCH_UP", 8)
    force_k(monkeypatch, [0] * 5 + [3] * 40)
    llm = LLM(str(trained_ckpt), block_size=4, max_num_batched_tokens=16)  # chunked: k=0 steps prefill them
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(sum(o.accepted_per_step) > 0 for o in outs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("schedule", [[3, 3, 0, 0, 0, 0, 1, 4, 4], [0, 0, 0, 0, 3, 3], [4, 2, 0, 4, 1, 0, 3],
                                      [4, 3, 3, 4, 3, 4, 4]])
def test_mtp_kv_stays_teacher_forced_after_k_falls_and_rises(partly_trained: Path, monkeypatch: pytest.MonkeyPatch,
                                                              schedule: list[int], overlap: bool) -> None:
    """Also with async scheduling, where k may change in a step planned while the one before still runs."""
    force_k(monkeypatch, schedule)
    llm = LLM(str(partly_trained), block_size=4, async_scheduling=overlap)
    runner = llm.engine.executor.runner
    checked = 0
    with torch.inference_mode():
        for prompt in prompts_of(64, [5, 13, 2, 21], seed=4):  # one at a time: a finished request stays until the next plan
            out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
            req = runner.requests[out.request_id]
            checked += _assert_pools_match(llm, req, _teacher_forced_keys(llm, prompt + out.token_ids), 4)
    assert checked > 100
    assert (runner.num_catch_ups > 0) == (min(schedule) < 3)  # only a k below the 3 modules leaves some behind
    assert not overlap or llm.engine.num_overlapped_steps > 0


@pytest.mark.parametrize("schedule", [
    [3, 1],  # the prefill drafts 3, the next step verifies only 1 of them (k fell)
    [0, 3],  # the prefill runs no module; the next step catches all of them up from position 0 and samples
])
def test_sampled_auto_keeps_the_target_distribution(small_vocab_ckpt: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                     schedule: list[int]) -> None:
    force_k(monkeypatch, schedule + [4] * 8)
    s = SETTINGS["penalties"]
    llm = LLM(str(small_vocab_ckpt), max_num_seqs=1024, max_num_batched_tokens=8192, seed=7)
    outs = llm.generate([PROMPT] * SAMPLES, SamplingParams(max_tokens=5, ignore_eos=True, **s))
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, ([o.token_ids[0] for o in outs], [o.token_ids[1] for o in outs]), 1)
    assert llm.engine.spec.num_accepted_tokens > 0
    assert chi_square_pvalue(counts, _exact_joint(small_vocab_ckpt, s)) > ALPHA


def test_catch_ups_verify_no_drafts_and_take_prefill_steps(partly_trained: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A rise of k past lagging modules plans no drafts for the request, so the workers' rewind is an aligned
    prompt chunk that the prefill step runs (docs/design.md §8), not a general-path pass."""
    force_k(monkeypatch, [1, 1, 1, 4, 4, 4])
    llm = LLM(str(partly_trained), block_size=4, max_num_seqs=8)
    runner = llm.engine.executor.runner
    general, inner = [], runner._run_general
    runner._run_general = lambda reqs, plan: general.append(len(reqs)) or inner(reqs, plan)
    prefills = runner.prefill.runs
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0, block_size=4)
                .generate(prompts_of(64, [9, 14, 5], seed=8), GREEDY)]
    assert [o.token_ids for o in llm.generate(prompts_of(64, [9, 14, 5], seed=8), GREEDY)] == expected
    assert runner.num_catch_ups >= 3 and runner.prefill.runs - prefills > runner.num_catch_ups // 3
    assert not general, "every catch-up was an aligned chunk without drafts"


@pytest.mark.parametrize("max_catch_up", [256, 27])
def test_catch_ups_stay_within_the_steps_token_budget(partly_trained: Path, monkeypatch: pytest.MonkeyPatch,
                                                      max_catch_up: int) -> None:
    """A rise of k past lagging modules rewinds each request over its lag: the scheduler counts those positions
    against max_num_batched_tokens, and a request the step cannot hold keeps its live modules' drafts and catches up
    in a later step, leaving every other request its own token. Eight requests lag for 12 steps (14-24 positions
    each); with a budget of 64 the workers' rewinds spread over several steps, none past the budget, no
    request sits one out, and the outputs stay those without speculation. A catch-up deferred so is owed: with
    MAX_CATCH_UP 27 a request whose lag was 24 at the rise waits its turn until the lag is past 27 (the lags grow
    about one a step at k = 1), and still catches up."""
    monkeypatch.setattr(Scheduler, "MAX_CATCH_UP", max_catch_up)
    prompts = prompts_of(64, [5, 9, 14, 7, 11, 6, 13, 8], seed=21)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)  # long enough for every catch-up
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0).generate(prompts, params)]
    force_k(monkeypatch, [3] * 2 + [1] * 12 + [3] * 60)
    llm = LLM(str(partly_trained), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    runner, computed, counted, whole, lags = llm.engine.executor.runner, [], [], [], []
    catch_up = runner._catch_up

    def recorded(reqs, plan):  # each step's positions as the workers compute them, rewinds included
        rewound = catch_up(reqs, plan)
        if rewound is not plan:
            computed.append(sum(rewound.num_tokens) + sum(rewound.num_drafts))
            # The lag caught up: the rewind less the 2 positions module 2 (of 3) commits behind the target.
            lags.extend(b - a - 2 for a, b in zip(plan.num_tokens, rewound.num_tokens) if b > a)
            counted.append(plan.catch_up_tokens)
            whole.append(len(plan.req_ids) == len(llm.engine.scheduler.running))
        return rewound

    runner._catch_up = recorded
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert runner.num_catch_ups == len(prompts)  # every request caught up, once
    assert len(computed) > 2, computed  # not all in one step
    assert max(computed) <= 64, computed
    assert all(c > 0 for c in counted)  # the plans said they carried catch-ups (no decode lap: the engine's clock)
    assert all(whole), whole  # every running request had its step beside the catch-ups
    # With MAX_CATCH_UP 27 one owed past it still caught up; with 256 every lag stayed within it.
    assert (max(lags) > max_catch_up) == (max_catch_up < 256), lags


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_k_past_the_modules_falls_and_rises_without_a_catch_up(partly_trained: Path, monkeypatch: pytest.MonkeyPatch,
                                                               overlap: bool) -> None:
    """k = 4 over 3 modules runs the last module again: from 4 to 3 and back leaves no module behind, so the rise
    verifies the drafts in hand (a catch-up would plan decode steps without drafts) and the overlapped pipeline
    runs on through it, as at a fixed k = 4."""
    prompts = prompts_of(64, [9, 14, 5, 7], seed=8)
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0).generate(prompts, GREEDY)]
    runs = {}
    for name, schedule in (("fixed", [4]), ("past the modules", [4, 3, 3, 4, 4, 3, 4, 4])):
        force_k(monkeypatch, schedule)
        llm = LLM(str(partly_trained), block_size=4, async_scheduling=overlap, max_num_seqs=4)
        assert llm.engine.resolved.num_mtp_modules == 3
        plans, sched = [], llm.engine.scheduler
        plan_step = sched.schedule

        def schedule_and_note() -> StepPlan:  # (tokens the request may still emit, tokens fed, drafts verified)
            plan = plan_step()
            plans.extend((sched.requests[r].tokens_left, n, d) for r, n, d in
                         zip(plan.req_ids, plan.num_tokens, plan.num_drafts))
            return plan

        sched.schedule = schedule_and_note
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        draftless = sum(1 for left, n, d in plans if n == 1 and d == 0 and left > 1)
        runs[name] = (draftless, llm.engine.num_overlapped_steps, llm.engine.executor.runner.num_catch_ups)
    assert runs["past the modules"][0] == runs["past the modules"][2] == 0
    assert runs["past the modules"][1] == pytest.approx(runs["fixed"][1], abs=2)
    assert not overlap or runs["fixed"][1] > 10
