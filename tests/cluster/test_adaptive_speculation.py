"""Adaptive speculation end to end on CPU (docs/design.md §9): whatever k the engine chooses, step by step,
outputs are those without speculation (greedy) or have the target distribution (sampled), and every
committed MTP KV entry stays the teacher-forced one after k falls to 0 and rises again.

The chooser is forced through fixed schedules here (down to 0 and back up, in decode and in prefill), so
that every switch and catch-up happens in a few steps on a tiny model; test_spec_chooser.py tests what
it would choose.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch

import mtpserve.cluster.engine as engine_module
import mtpserve.cluster.spec_chooser as chooser_module
from mtpserve import LLM, SamplingParams
from mtpserve.boundary.messages import StepPlan
from mtpserve.cluster.scheduler import Scheduler
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.step_costs import StepCosts
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


def _timed_by_launches(model: Path, monkeypatch: pytest.MonkeyPatch, cost: Callable[[StepPlan, int], float],
                       async_scheduling: bool = True, **engine_args) -> tuple[LLM, list[float], SimpleNamespace]:
    """An engine (async by default) whose clock moves only when a step is launched, by cost(plan, launches so far),
    and the step-cost samples it learns, as whole laps (appended as they come; on the CPU the runner works
    inside the launch, so the engine takes that time for the device's share and the rest for the host's)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock.now, monotonic=time.monotonic))
    llm = LLM(str(model), block_size=4, async_scheduling=async_scheduling, **engine_args)
    method = "submit" if async_scheduling else "execute"  # what the engine launches a step with
    submit, launches = getattr(llm.engine.executor, method), [0]

    def launch(plan: StepPlan):
        launches[0] += 1
        clock.now += cost(plan, launches[0])
        return submit(plan)

    monkeypatch.setattr(llm.engine.executor, method, launch)
    samples: list[float] = []
    observe = StepCosts.observe

    def observed(self: StepCosts, batch: int, k: int, device: float, host: float, overlapped: bool,
                 tokens: float, greedy: bool = True, lap: float = 0.0) -> None:
        assert not overlapped, "no device timed the step: the CPU runs it inside the launch"
        samples.append(device + host)
        observe(self, batch, k, device, host, overlapped, tokens, greedy, lap)

    monkeypatch.setattr(StepCosts, "observe", observed)
    return llm, samples, clock  # clock.now: the engine's time


def test_the_scheduler_prices_k_at_the_running_and_the_waiting_requests(partly_trained: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests admitted a few a step (a token budget of 40, prompts of 14-20 tokens): every choice made
    while some still wait is priced at the batch they will all run at, never at the few already running."""
    calls: list[tuple[int, int]] = []
    choose = AdaptiveSpec.choose
    monkeypatch.setattr(AdaptiveSpec, "choose", lambda self, rows, batch=None, newcomers_adaptive=True: (
        calls.append((rows.size, batch)), choose(self, rows, batch, newcomers_adaptive))[1])
    llm = LLM(str(partly_trained), block_size=4, max_num_seqs=8, max_num_batched_tokens=40)
    llm.generate(prompts_of(64, [14, 20, 16, 18, 15, 19, 17, 20], seed=5), GREEDY)
    ramp = [(n, b) for n, b in calls if 0 < n < 8]
    assert any(b == 8 for _, b in ramp), calls[:12]  # some ran while others waited: priced at all eight
    assert all(b <= 8 for _, b in calls) and calls[-1][0] == calls[-1][1]  # drained: the batch itself


def test_step_costs_are_learned_only_from_whole_step_periods(partly_trained: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With async scheduling a step launched synchronously does its work inside the lap before it, and the
    lap after it can be a few microseconds: such laps must not become step costs (on an H100 one made k = 0
    look 50x cheaper than it is, and the chooser ran 16 steps without drafts). The engine's clock here moves
    only when a step is launched, by one unit: a lap that is one whole step's period reads exactly 1."""
    llm, samples, _ = _timed_by_launches(partly_trained, monkeypatch, lambda plan, n: 1.0)
    for _ in range(3):  # closed loops that start and drain, so that sync and overlapped launches alternate
        llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), GREEDY)
    assert llm.engine.num_overlapped_steps > 20 and len(samples) > 20
    assert set(samples) == {1.0}, sorted(set(samples))


def test_a_lap_that_launched_a_prompt_is_not_a_step_cost(partly_trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed loop refilling its slots admits requests mid-run, and the in-process runner runs a step with
    prompt rows to its end when it is launched: a lap that contained such a launch would read a decode
    step plus a prefill. Admissions wait for a synchronous launch, which ends the pipeline, so no such lap
    is sampled. The fake clock moves by one unit per decode launch and by five per launch that admits."""
    llm, samples, _ = _timed_by_launches(partly_trained, monkeypatch, lambda plan, n: 5.0 if plan.new_requests else 1.0,
                                      max_num_seqs=2)
    llm.generate(prompts_of(64, [5, 9, 14, 20, 3, 11, 7], seed=12), GREEDY)  # 7 requests through 2 slots
    assert llm.engine.num_overlapped_steps > 20 and len(samples) > 20
    assert set(samples) == {1.0}, sorted(set(samples))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_lap_that_caught_modules_up_is_not_a_step_cost(partly_trained: Path, monkeypatch: pytest.MonkeyPatch,
                                                          overlap: bool) -> None:
    """A rise of k spread over several steps by the token budget: in the later ones the requests caught up before
    verify k drafts beside the catch-ups of the others, and such a lap would read a decode step plus a prefill (with
    async scheduling such a step is launched synchronously, which ends the pipeline anyway). The fake clock moves by
    five units per launch that carries catch-ups and by one per other launch."""
    force_k(monkeypatch, ([3] * 6 + [1] * 10) * 8)
    llm, samples, _ = _timed_by_launches(partly_trained, monkeypatch,
                                         lambda plan, n: 5.0 if plan.catch_up_tokens else 1.0, overlap,
                                         max_num_seqs=8, max_num_batched_tokens=48)
    spread = []  # per step with catch-ups, whether another request verified the step's k drafts in it
    method = "submit" if overlap else "execute"
    submit = getattr(llm.engine.executor, method)

    def watched(plan: StepPlan):
        if plan.catch_up_tokens:
            spread.append(max(plan.num_drafts) == max(plan.num_spec))
        return submit(plan)

    monkeypatch.setattr(llm.engine.executor, method, watched)
    llm.generate(prompts_of(64, [5, 9, 14, 7, 11, 6, 13, 8], seed=21), GREEDY)
    assert any(spread), spread  # the case this guards: a catch-up beside drafts at the step's k
    assert len(samples) > 10 and set(samples) == {1.0}, sorted(set(samples))


def test_a_lap_that_held_a_graph_capture_is_not_a_step_cost(partly_trained: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape first seen while serving (the window after k fell, a top-p batch) is captured inside the
    launch of its step, i.e. inside the lap of the step in flight: on the H100 that is tens of ms in a
    0.5 ms step's sample. The runner counts its captures and the engine leaves such laps out. Here every
    ninth launch "captures": the runner's count moves and the fake clock jumps by 50 units."""
    engine = SimpleNamespace(runner=None)  # set once the engine exists, before its first launch

    def cost(plan: StepPlan, n: int) -> float:
        if n % 9:
            return 1.0
        engine.runner.num_captures += 1
        return 51.0

    llm, samples, _ = _timed_by_launches(partly_trained, monkeypatch, cost)
    engine.runner = llm.engine.executor.runner
    for _ in range(3):
        llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), GREEDY)
    assert engine.runner.num_captures >= 5 and len(samples) > 20
    assert set(samples) == {1.0}, sorted(set(samples))


def test_a_lap_that_carried_the_choosers_work_is_not_a_step_cost(partly_trained: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The chooser's work (a full choice and the steps that prepare it) costs every k alike and is paced by the
    dwell. Kept, the laps that carried it widened the host's spread of speeds, and at T = 1, c = 8 on the H200 the
    choices priced host-bound k = 2 at 0.53-0.71 ms where its steps took 0.49 (run 279). Here the host line's
    refit, two steps ahead of each full choice, takes half a unit of the fake clock."""
    llm, samples, clock = _timed_by_launches(partly_trained, monkeypatch, lambda plan, n: 1.0)
    monkeypatch.setattr(chooser_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    refit, refits = StepCosts.refit, [0]

    def slow_refit(self: StepCosts, batch: int) -> None:
        refits[0] += 1
        clock.now += 0.5
        refit(self, batch)

    monkeypatch.setattr(StepCosts, "refit", slow_refit)
    for _ in range(3):
        llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), GREEDY)
    assert refits[0] >= 3 and len(samples) > 20
    assert set(samples) == {1.0}, sorted(set(samples))


def test_a_lap_splits_into_the_runners_share_and_the_hosts(partly_trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step-cost model prices every k with the host's share as it is now (design §9), so the engine
    must tell the two apart: the time inside the executor is the device's share where the step runs
    serially (the CPU), the rest of the lap the host's. The fake clock moves by one unit per launch and
    by a quarter whenever the scheduler plans an overlapped step."""
    llm, _, clock = _timed_by_launches(partly_trained, monkeypatch, lambda plan, n: 1.0)
    shares: list[tuple[float, float]] = []
    emitted: list[tuple[int, float]] = []
    observe = StepCosts.observe
    monkeypatch.setattr(StepCosts, "observe", lambda self, batch, k, device, host, overlapped, tokens, greedy, lap: (
        shares.append((device, host)), emitted.append((batch, tokens, greedy)),
        observe(self, batch, k, device, host, overlapped, tokens, greedy, lap)))
    scheduler = llm.engine.scheduler
    plan_overlapped = scheduler.schedule_overlapped

    def slow_planning(plan: StepPlan) -> StepPlan | None:
        clock.now += 0.25
        return plan_overlapped(plan)

    monkeypatch.setattr(scheduler, "schedule_overlapped", slow_planning)
    llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), GREEDY)
    assert len(shares) > 10 and set(shares) == {(1.0, 0.25)}, sorted(set(shares))
    assert llm.engine.adaptive.costs.host(5) == 0.25
    # and the tokens each step emitted, which the host's share grows with: one per request and its accepted drafts
    assert all(batch <= tokens <= batch * 4 for batch, tokens, _ in emitted) and any(t > b for b, t, _ in emitted)
    assert all(greedy for _, _, greedy in emitted)  # a greedy batch's steps feed the greedy table


def test_reading_the_result_back_is_the_hosts_share_not_the_devices(partly_trained: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapped on a GPU, the executor's wait both blocks on the device and reads the packed rows back into
    lists for every request; only the blocking is the device's. Counted whole, the read-back (host work that
    grows with the batch) made the host-bound laps of c = 256 on the H100 look device-bound, and the gap
    learned from them priced every k at 7 ms. Here a launch moves the clock by one unit and a wait by 0.6,
    of which the result says 0.1 were spent blocked (a CUDA runner's events also timed 0.3 of device work)."""
    observe = StepCosts.observe  # before _timed_by_launches wraps it for serial steps
    llm, _, clock = _timed_by_launches(partly_trained, monkeypatch, lambda plan, n: 1.0)
    executor, shares = llm.engine.executor, []
    wait = executor.wait

    def timed_wait(handle):
        result = wait(handle)
        clock.now += 0.6
        result.device_seconds, result.blocked_seconds = 0.3, 0.1
        return result

    monkeypatch.setattr(executor, "wait", timed_wait)
    monkeypatch.setattr(StepCosts, "observe", lambda self, batch, k, device, host, overlapped, tokens, greedy, lap: (
        shares.append((device, round(host, 9), overlapped, round(lap, 9))),
        observe(self, batch, k, device, host, overlapped, tokens, greedy, lap)))
    llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), GREEDY)
    assert len(shares) > 10 and set(shares) == {(0.3, 1.5, True, 1.6)}, sorted(set(shares))
    assert llm.engine.adaptive.costs.gap(5) == 0.0  # blocked 0.1 of a 1.6 lap: host-bound, no gap learned


def test_a_sampled_batch_feeds_the_sampled_step_costs(partly_trained: Path) -> None:
    """A sampled step costs the device more than a greedy one at the same k (design §9): the engine files
    each timed step under its batch's sampling mode, and the chooser reads that mode's table."""
    llm = LLM(str(partly_trained), block_size=4, async_scheduling=True)
    sampled = SamplingParams(max_tokens=32, temperature=1.0, seed=3, ignore_eos=True)
    llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), sampled)
    adaptive = llm.engine.adaptive
    modes = adaptive.costs.modes
    assert modes[False].samples.sum() > 0 and modes[True].samples.sum() == 0 and not adaptive.greedy
    llm.generate(prompts_of(64, [5, 9, 14, 20, 3], seed=11), GREEDY)
    assert modes[True].samples.sum() > 0 and adaptive.greedy
