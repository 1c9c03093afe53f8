"""benchmarks/interleaved.py: auto against fixed k in short cells interleaved round by round, an engine per variant."""

from __future__ import annotations

import sys
from pathlib import Path

from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cell_phases  # noqa: E402
import interleaved  # noqa: E402

from mtpserve.cluster.spec_config import AdaptiveConfig  # noqa: E402


def test_a_steady_ratio_has_no_spread() -> None:
    auto = [(200, 1.0, 2.0), (100, 0.5, 2.0), (300, 1.5, 2.0)]  # 200 tok/s in every round
    fixed = [(100, 1.0, 1.5), (50, 0.5, 1.5), (150, 1.5, 1.5)]  # 100 tok/s
    assert interleaved.ratio_interval(auto, fixed) == pytest.approx((2.0, 2.0, 2.0))


def test_the_ratio_is_of_sums_and_its_interval_spans_the_rounds() -> None:
    # The host slows 2x in the second round, for both variants alike: the paired ratio stays 1.1 per round.
    auto = [(110, 1.0, 2.0), (110, 2.0, 2.0), (121, 1.0, 2.0), (99, 1.0, 2.0)]
    fixed = [(100, 1.0, 2.0), (100, 2.0, 2.0), (100, 1.0, 2.0), (100, 1.0, 2.0)]
    ratio, low, high = interleaved.ratio_interval(auto, fixed)
    assert ratio == pytest.approx(440 / 5.0 / (400 / 5.0))
    assert low < ratio < high and 0.99 <= low and high <= 1.21


def test_a_tiny_run_reports_every_variant_against_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,auto", "--rounds", "2", "--no-results"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("MTP")]
    assert [r[0] for r in rows] == ["MTP1", "MTPauto"]
    assert all(r[2] == "2" and int(r[3]) == 2 * 2 * 16 for r in rows), rows  # two cells of two 16-token requests
    assert float(rows[0][6]) > 0 and rows[1][6] == "-"


def test_an_auto_variant_runs_auto_with_its_config_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interleaved.parse_variants("1, auto,auto:max_probe_wait=1+hysteresis=0.02") == [
        1, "auto", "auto:max_probe_wait=1+hysteresis=0.02"]
    assert [interleaved.speculation(v) for v in (2, "auto", "auto:hysteresis=0.1")] == [2, "auto", "auto"]
    built = {}
    build = interleaved.build_engines

    def keep(*args, **kwargs):  # the engines as built, for their choosers' configs
        built.update(build(*args, **kwargs))
        return built

    monkeypatch.setattr(interleaved, "build_engines", keep)
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "auto,auto:max_probe_wait=1+hysteresis=0.02",
                             "--rounds", "2", "--no-results"]) == 0
    plain, tuned = (built[v].adaptive for v in ("auto", "auto:max_probe_wait=1+hysteresis=0.02"))
    assert (plain.config.max_probe_wait, plain.config.hysteresis) != (1, 0.02)
    assert (tuned.config.max_probe_wait, tuned.config.hysteresis) == (1, 0.02)
    assert tuned.chosen.sum() > 0  # its requests ran as "auto": the chooser chose their steps


def test_a_copy_is_another_engine_of_its_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert interleaved.parse_variants("1,1#b,auto,auto#2") == [1, "1#b", "auto", "auto#2"]
    assert [interleaved.speculation(v) for v in ("1#b", "auto#2", "auto:hysteresis=0.1#c")] == [1, "auto", "auto"]
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,1#b", "--rounds", "2", "--no-results"]) == 0
    out = capsys.readouterr().out
    assert "copies at c = 1" in out
    copy = next(line.split() for line in out.splitlines() if line.split()[:2] == ["MTP1#b", "MTP1"])
    assert copy[2] == "2" and 0.5 < float(copy[3]) < 2.0, copy  # two rounds, a ratio of two like engines


@pytest.mark.parametrize("ks, message", [("1,2#b", "copies 2, which is not among"), ("1,1", "names a variant twice"),
                                         ("1,x#b,two", r"\['x#b', 'two'\]: a variant is a draft count")])
def test_a_copy_of_nothing_or_a_variant_named_twice_is_refused(ks: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        interleaved.parse_variants(ks)


@pytest.mark.parametrize("variant, message", [("auto:hysteresis", "auto:FIELD=VALUE"),
                                               ("auto:no_such_field=1", "no field ['no_such_field']")])
def test_a_malformed_auto_variant_is_refused_with_what_is_wrong(variant: str, message: str) -> None:
    engine = SimpleNamespace(adaptive=SimpleNamespace(config=AdaptiveConfig(max_k=2, max_rows=1)))
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        interleaved.tune(engine, variant)
    interleaved.tune(engine, "auto:hysteresis=0.5+min_dwell=3")
    assert (engine.adaptive.config.hysteresis, engine.adaptive.config.min_dwell) == (0.5, 3)


def test_rounds_past_the_prompt_pool_reuse_its_rounds() -> None:
    args = interleaved.parse_args(["--tiny", "--workload", "random", "--rounds", "5", "--requests-per-cell", "256"])
    rounds = interleaved.round_prompts(args, vocab=100, n=interleaved.cell_size(args, 128))
    assert len(rounds) == 5 and all(len(r) == 256 for r in rounds)
    assert rounds[0] != rounds[1] and rounds[2] == rounds[0] and rounds[3] == rounds[1]  # 600 // 256 = 2 distinct


def test_a_cell_is_twice_the_concurrency_unless_given() -> None:
    args = interleaved.parse_args(["--tiny"])
    assert [interleaved.cell_size(args, c) for c in (1, 8, 128)] == [2, 16, 256]
    assert interleaved.cell_size(interleaved.parse_args(["--tiny", "--requests-per-cell", "5"]), 128) == 5


def test_rounds_stop_where_the_next_would_not_fit_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the first, a round starts only where the last one's time still fits before the deadline."""
    clock = [0.0]
    monkeypatch.setattr(interleaved.time, "monotonic", lambda: clock[0])

    def drive(engine: object, jobs: list, c: int, name: str) -> object:
        clock[0] += 1.0  # each cell takes a second
        return SimpleNamespace(num_tokens=10, wall=1.0, spec=SimpleNamespace(acceptance_length=2.0))

    monkeypatch.setattr(interleaved.workloads, "drive", drive)
    args = interleaved.parse_args(["--tiny", "--rounds", "10"])
    rounds = [[[1, 2, 3]]] * 10
    cells = interleaved.run_rounds(args, {1: None, "auto": None}, rounds, 1, deadline=7.0)
    assert [len(v) for v in cells.values()] == [3, 3]  # rounds of 2 s each: started at 0, 2 and 4; 6 + 2 > 7
    assert [len(v) for v in interleaved.run_rounds(args, {1: None, "auto": None}, rounds, 1).values()] == [10, 10]


def test_phases_sum_each_variants_steps_over_its_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,auto", "--concurrency", "4", "--rounds", "2",
                             "--max-tokens", "16", "--no-results", "--phases"]) == 0
    out = capsys.readouterr().out
    table = out.split("phases at c = 4")[1]
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip().startswith("MTP")}
    assert set(rows) == {"MTP1", "MTPauto"}
    fixed = rows["MTP1"].split("MTP1", 1)[1]
    cells = [c.strip() for c in fixed.split("  ") if c.strip()]
    assert len(cells) == 7 and cells[-2:] == ["0", "0"]  # five phases; a fixed k never chooses, nor moves
    full_steps, full_ms, _ = (float(x) for x in cells[0].split(" / "))
    assert full_steps >= 4 and full_ms > 0  # two cells of 8 requests of 16 tokens, 4 at a time: full steps in each
    prompt_steps = int(cells[2].split(" / ")[0])
    assert prompt_steps >= 2  # each of the two cells starts with a prompt step


def test_phases_count_the_steps_whose_k_moved() -> None:
    """'k moved': the steps whose k was not the step's before, within a cell (the first step of a cell moves
    nothing)."""
    sums = interleaved.PhaseSums.__new__(interleaved.PhaseSums)
    sums.sums, sums.full, sums.drain = {"auto": {}}, {"auto": {}}, {"auto": []}
    for ks in ([2, 2, 3, 3, 2, 2], [3, 3, 3, 2, 2, 2]):  # the second cell starts at another k than the first ended
        records = [cell_phases.StepRecord(0.001 * (i + 1), 4, 0, 3, k, 0, 0.0, 0) for i, k in enumerate(ks)]
        sums.tracers = {"auto": SimpleNamespace(records=records)}
        sums.parts = {"auto": SimpleNamespace(steps=[{"step": r.seconds} for r in records])}
        sums.add("auto", 4)
    steps, seconds, tokens = sums.sums["auto"]["k moved"]
    assert (steps, tokens) == (3, 9) and seconds == pytest.approx(0.003 + 0.005 + 0.004)
    assert sums.sums["auto"]["full"][0] == 12
    # Full steps at the k of the step before (the first step of a cell counts as such): their parts, per k.
    assert {k: len(v) for k, v in sums.full["auto"].items()} == {2: 5, 3: 4}


def test_autos_same_k_steps_are_split_by_the_steps_since_its_chooser_worked() -> None:
    """A step whose chooser preparation ran (over CHOOSER_WORKED) or that chose resets the count; auto's rows are
    split at IDLE steps since, a fixed k's never."""
    sums = interleaved.PhaseSums.__new__(interleaved.PhaseSums)
    sums.sums, sums.full, sums.drain = {"auto": {}, 4: {}}, {"auto": {}, 4: {}}, {"auto": [], 4: []}
    worked = {5, 20, 30}  # the chooser prepared in these steps
    for v in ("auto", 4):
        records = [cell_phases.StepRecord(0.001, 4, 0, 5, 4, 0, 0.0, 0) for _ in range(40)]
        sums.tracers = {v: SimpleNamespace(records=records)}
        sums.parts = {v: SimpleNamespace(steps=[{"step": 0.001, "prepare": 1e-4 if v == "auto" and i in worked
                                                 else 1e-6} for i in range(40)])}
        sums.add(v, 4)
    since = [parts["since"] for _, parts in sums.full["auto"][4]]
    assert since[:8] == [5, 6, 7, 8, 9, 0, 1, 2] and since[30:33] == [0, 1, 2]
    [table] = sums.parts_tables(4)
    names = [row[0] for row in table.rows]
    near = sum(1 for s in since if s < interleaved.IDLE)
    assert names == ["MTPauto", "MTP4", "MTPauto, chooser 0-3 steps back", "MTPauto, chooser 4+ steps back"]
    assert [row[1] for row in table.rows] == ["40", "40", str(near), str(40 - near)]


def test_drain_steps_get_a_parts_table_with_autos_choices_apart() -> None:
    """Steps after a cell's last prompt step below the full batch are the drain's: every one of them (any k) goes in
    its own parts table, auto's split by whether the step chose."""
    sums = interleaved.PhaseSums.__new__(interleaved.PhaseSums)
    sums.sums, sums.full, sums.drain = {"auto": {}, 4: {}}, {"auto": {}, 4: {}}, {"auto": [], 4: []}
    for v in ("auto", 4):
        # A prompt step, 10 full steps, then 20 drain steps from 3 requests down, auto choosing in every fifth.
        records = [cell_phases.StepRecord(0.002, 4, 9, 4, 4, 0, 0.0, 0)]
        records += [cell_phases.StepRecord(0.001, 4, 0, 5, 4, 0, 0.0, 0) for _ in range(10)]
        records += [cell_phases.StepRecord(0.003 if v == "auto" and i % 5 == 0 else 0.001, 3 - i // 10, 0, 5, 4, 0,
                                           0.0, 0, chose=v == "auto" and i % 5 == 0) for i in range(20)]
        sums.tracers = {v: SimpleNamespace(records=records)}
        sums.parts = {v: SimpleNamespace(steps=[{"step": r.seconds} for r in records])}
        sums.add(v, 4)
    drain = sums.parts_tables(4)[-1]
    assert "drain" in drain.title
    rows = {row[0]: row[1:3] for row in drain.rows}
    assert rows == {"MTPauto": ["20", "1400"], "MTP4": ["20", "1000"], "MTPauto, held": ["16", "1000"]}
    # (auto's 4 choosing steps are under the 10 steps a row needs: no row of their own)


def test_a_shared_variant_runs_its_k_on_another_variants_engine(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert interleaved.parse_variants("1,auto,1@auto") == [1, "auto", "1@auto"]
    assert interleaved.parse_variants("1,auto,auto#b,1@auto#b") == [1, "auto", "auto#b", "1@auto#b"]  # a copy's own
    assert (interleaved.speculation("1@auto"), interleaved.host("1@auto"), interleaved.host(1)) == (1, "auto", 1)
    built = {}
    build = interleaved.build_engines

    def keep(*args, **kwargs):
        built.update(build(*args, **kwargs))
        return built

    monkeypatch.setattr(interleaved, "build_engines", keep)
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,auto,1@auto", "--rounds", "2", "--phases",
                             "--no-results"]) == 0
    assert built["1@auto"] is built["auto"] and built[1] is not built["auto"]  # two engines for three variants
    out = capsys.readouterr().out
    shared = next(line.split() for line in out.splitlines() if line.split()[:2] == ["MTP1@auto", "MTP1"])
    assert shared[2] == "2"  # its cells over fixed k = 1's own, paired by round
    phases = out.split("phases at c = 1")[1]
    assert any(line.split()[:1] == ["MTP1@auto"] and "/" in line for line in phases.splitlines())


@pytest.mark.parametrize("ks, message", [("1,1@2", "runs on 2's engine"), ("1,auto,1@auto#b", "runs on 'auto#b'"),
                                         ("1,auto,auto@1", "a variant is a draft count")])
def test_a_shared_variant_needs_its_host_among_the_variants(ks: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        interleaved.parse_variants(ks)
