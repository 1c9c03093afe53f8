"""benchmarks/cell_phases.py: a cell's steps, recorded as the engine runs them, and each put in its phase (the
split the closed loop's ranking of k's was read from in session U)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.sampling_params import SamplingParams
from tests.conftest import prompts_of

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cell_phases  # noqa: E402
import token_counts  # noqa: E402
import workloads  # noqa: E402


def _record(batch: int, prompt: int = 0, catch_ups: int = 0) -> cell_phases.StepRecord:
    return cell_phases.StepRecord(0.001, batch, prompt, batch, 2, catch_ups, 1e-4, 0)


def test_each_step_gets_the_phase_of_its_kind() -> None:
    steps = [_record(2, prompt=10), _record(4, prompt=3), _record(4), _record(3), _record(4, prompt=5),
             _record(4, catch_ups=2), _record(4), _record(2), _record(1)]
    assert cell_phases.phase_of(steps, 4) == ["prompt", "prompt", "full", "partial", "prompt", "catch-up", "full",
                                              "drain", "drain"]


def test_a_traced_cell_accounts_for_every_token_and_step(trained_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(trained_ckpt), device="cpu", dtype="float32", max_num_seqs=2))
    tracer = cell_phases.StepTracer(engine)
    lengths = [12, 12, 12, 24]  # the last request decodes on alone: the cell drains
    jobs = [workloads.Job(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, num_speculative_tokens=2))
            for p, n in zip(prompts_of(64, [6, 7, 8, 9], seed=1), lengths)]
    tracer.start()
    run = workloads.drive(engine, jobs, 2, "cell")
    records = tracer.records
    assert len(records) == run.engine_steps
    assert sum(r.tokens for r in records) == run.num_tokens == sum(lengths)
    assert {r.k for r in records if r.batch} == {2}
    assert all(r.batch <= 2 and r.seconds > 0 for r in records)
    phases = cell_phases.phase_of(records, 2)
    assert phases[0] == "prompt" and "full" in phases and phases[-1] == "drain"
    cells = cell_phases.phase_cells(records, 2)
    assert cells[-1] == f"2:{sum(1 for r in records if r.batch)}"


def test_the_cost_tracer_reports_what_the_step_costs_were_fed_per_k(trained_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(trained_ckpt), device="cpu", dtype="float32", max_num_seqs=2))
    costs = cell_phases.CostTracer(engine)
    jobs = [workloads.Job(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=2))
            for p in prompts_of(64, [6, 7, 8, 9], seed=2)]
    workloads.drive(engine, jobs, 2, "cell")
    full = [s for s in costs.samples if s[0] == 2]
    assert full and {k for _, k, _, _, _ in full} == {2}
    assert all(lap >= host_s >= 0 and device > 0 for _, _, lap, host_s, device in full)
    line = costs.take(2)
    assert line.startswith(f"k=2: {len(full)} laps, ") and costs.samples == []
    assert costs.take(2) == ""


def test_the_excess_of_full_steps_is_split_out_where_a_choice_was_made() -> None:
    def step(seconds: float, chose: bool = False) -> cell_phases.StepRecord:
        return cell_phases.StepRecord(seconds, 2, 0, 2, 2, 0, 1e-5, 0, chose)

    # Median lap 1 ms: the two slow steps exceed it by 0.5 and 2 ms, the second with a choice, the first not;
    # a step that chose within the median lap adds nothing.
    full = [step(0.001)] * 4 + [step(0.001, True), step(0.0015), step(0.003, True)]
    assert cell_phases.excess_cell(full) == "2.5 / 2.0 in 2"


def test_the_slowest_full_steps_are_listed_in_step_order_with_what_ran_in_them() -> None:
    def step(seconds: float, k: int = 2, prompt: int = 0, gc_seconds: float = 0.0) -> cell_phases.StepRecord:
        return cell_phases.StepRecord(seconds, 2, prompt, 2, k, 0, 2e-5, 0, k == 3, gc_seconds)

    # A prompt step's long lap is no full step's; of the full steps, the 4 ms one (after a change of k, with a
    # choice) and the 3 ms one (garbage collected) lie furthest above the 1 ms median.
    records = [step(0.009, prompt=5), step(0.001), step(0.003, gc_seconds=0.002), step(0.001), step(0.004, k=3),
               step(0.001), step(0.001)]
    lines = cell_phases.outlier_lines(records, 2, 2)
    assert lines == ["step 2: lap 3.000 ms (+2.000), k 2 -> 2, sched 20 us, 0 faults, gc 2.00 ms, after a full step",
                     "step 4: lap 4.000 ms (+3.000), k 2 -> 3, chose, sched 20 us, 0 faults, gc 0.00 ms, after a "
                     "full step"]
    assert cell_phases.outlier_lines(records[:1], 2, 2) == []


def test_the_gc_clock_counts_a_collection() -> None:
    clock = cell_phases.GcClock()
    try:
        before = clock.seconds
        gc.collect()
        assert clock.seconds > before
    finally:
        gc.callbacks.remove(clock._on_gc)


def test_a_traced_auto_cell_marks_the_steps_where_a_choice_was_made(trained_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(trained_ckpt), device="cpu", dtype="float32", max_num_seqs=2))
    tracer = cell_phases.StepTracer(engine)
    jobs = [workloads.Job(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                            num_speculative_tokens="auto"))
            for p in prompts_of(64, [6, 7, 8, 9], seed=4)]
    tracer.start()
    workloads.drive(engine, jobs, 2, "cell")
    chose = [r.chose for r in tracer.records]
    assert chose[0] and 0 < sum(chose) < len(chose)  # the first step chooses, later ones hold a dwell


def test_the_outcome_tracer_draws_each_ks_tokens_from_the_cells_steps(trained_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(trained_ckpt), device="cpu", dtype="float32", max_num_seqs=2))
    outcomes = cell_phases.OutcomeTracer(engine)
    jobs = [workloads.Job(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=2))
            for p in prompts_of(64, [6, 7, 8, 9], seed=3)]
    run = workloads.drive(engine, jobs, 2, "cell")
    steps = list(outcomes.outcomes)
    assert steps and {d for d, _ in steps} == {2} and all(0 <= a <= 2 for _, a in steps)
    assert sum(a for _, a in steps) == run.spec.num_accepted_tokens  # every verified step, as the engine counted
    own = sum(a + 1 for _, a in steps) / len(steps)  # at the cell's own k both give its acceptance length
    line = outcomes.take(3)
    assert line.startswith(f"k = 1..3: product {token_counts.product_tokens(steps, 1):.2f} {own:.2f} nan, counted ")
    assert line.endswith(f" {own:.2f} nan") and outcomes.outcomes == []


def test_a_traced_choice_shows_what_its_cost_row_is_made_of(trained_ckpt: Path) -> None:
    """Each traced choice prints its host share, device share and the host's speeds beside the row: on the CPU's
    serial steps a k costs its device share plus its host share at the mean speed (speeds capped at 2)."""
    import ast
    import re

    engine = LLMEngine(EngineConfig(model=str(trained_ckpt), device="cpu", dtype="float32", max_num_seqs=2))
    choices = cell_phases.ChoiceTracer(engine)
    jobs = [workloads.Job(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                            num_speculative_tokens="auto"))
            for p in prompts_of(64, [6, 7, 8, 9], seed=4)]
    try:
        workloads.drive(engine, jobs, 2, "cell")
    finally:
        cell_phases.spec_chooser.choose_k = choices.choose  # the tracer wraps the module's function in place
    lines = choices.take()
    assert lines
    for line in lines:
        lists = {name: ast.literal_eval(value) for name, value in
                 re.findall(r"(cost ms|host ms|device \+ gap ms|speeds) (\[[^\]]*\])", line)}
        assert set(lists) == {"cost ms", "host ms", "device + gap ms", "speeds"}, line
        low, *_, high = lists["speeds"]
        assert 0 < low <= high <= 2.0
        for cost, host, floor in zip(lists["cost ms"], lists["host ms"], lists["device + gap ms"]):
            assert floor + low * host - 2e-3 <= cost <= floor + high * host + 2e-3, line
