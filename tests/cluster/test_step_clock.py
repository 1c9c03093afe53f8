"""What the engine learns as a step's cost for adaptive speculation (docs/design.md §9): whole laps of one step's
period only (not those that launched a prompt, caught modules up, captured a graph or carried the chooser's work),
split into the runner's share and the host's, priced at the batch the decode will run at, per sampling mode.

The engine's clock is replaced by one that moves only when a step is launched (_timed_by_launches), so that
each lap's length is known exactly.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

import mtpserve.cluster.engine as engine_module
import mtpserve.cluster.spec_chooser as chooser_module
from mtpserve import LLM, SamplingParams
from mtpserve.boundary.messages import StepPlan
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.step_costs import StepCosts
from tests.cluster.test_adaptive_speculation import force_k
from tests.conftest import prompts_of

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


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
