"""benchmarks/choice_windows.py: the untimed steps around auto's choices, counted from a run's samples."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import choice_windows  # noqa: E402
import cost_samples  # noqa: E402
import interleaved  # noqa: E402

V = "k=auto c=4"


def _stream(gaps: list[tuple[int, float, bool]], lap: float = 1.0, batch: int = 4) -> list[dict]:
    """Samples of laps `lap` at k = 2, one step apart except where `gaps` puts (untimed steps, their seconds, a choice
    among them) after the sample of that index."""
    records, t, step = [], 0.0, 0
    for i in range(12):
        step, t = step + 1, t + lap
        records.append({"kind": "sample", "variant": V, "round": 0, "t": t, "batch": batch, "k": 2, "lap": lap,
                        "step": step})
        for after, steps, seconds, chose in gaps:
            if after == i:
                if chose:
                    records.append({"kind": "choice", "variant": V, "round": 0, "t": t + seconds / 2})
                step, t = step + steps, t + seconds
    return records


def test_a_stretch_with_a_choice_is_priced_against_the_laps_around_it() -> None:
    # four untimed steps that took 4.5 laps around a choice, two that took 2 laps without one
    records = _stream([(3, 4, 4.5, True), (8, 2, 2.0, False)])
    found = choice_windows.stretches(records, V, 4)
    assert [(s.chose, s.steps) for s in found] == [(True, 4), (False, 2)]
    assert found[0].extra == pytest.approx(0.5) and found[1].extra == pytest.approx(0.0)
    s = choice_windows.summary(records, V, 4)
    assert s["choices per cell"] == 1
    assert s["choice extra laps each"] == pytest.approx(0.5)
    assert s["choice extra share"] == pytest.approx(0.5 / 18.5)  # 12 laps timed + 6.5 s untimed
    assert s["other stretches"] == 1 and s["other extra s"] == pytest.approx(0.0)


def test_a_stretch_with_a_choice_and_a_prompt_step_is_not_counted_as_the_choices() -> None:
    records = _stream([(3, 4, 4.5, True), (8, 3, 5.0, True)])
    for r in records:  # a request admitted within the second stretch (after the sample of index 8)
        r["admitted"] = 1 if r["kind"] == "sample" and r["step"] > 9 + 4 else 0
    found = choice_windows.stretches(records, V, 4)
    assert [(s.chose, s.admitted) for s in found] == [(True, False), (True, True)]
    s = choice_windows.summary(records, V, 4)
    assert s["choice stretches"] == 1 and s["choice extra laps each"] == pytest.approx(0.5)
    assert s["other stretches"] == 0


def test_stretches_across_another_batch_or_k_are_left_out() -> None:
    records = _stream([(3, 4, 4.5, True)])
    [r for r in records if r["kind"] == "sample"][4]["k"] = 3  # the step after the stretch ran another k
    assert choice_windows.stretches(records, V, 4) == []
    assert choice_windows.stretches(_stream([(3, 4, 4.5, True)], batch=3), V, 4) == []


def test_a_tiny_interleaved_dump_is_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json.gz"
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,auto", "--concurrency", "4", "--rounds", "2",
                             "--max-tokens", "24", "--no-results", "--dump-samples", str(path)]) == 0
    samples = [r for r in cost_samples.load(path) if r["kind"] == "sample"]
    steps = [r["step"] for r in samples if r["variant"] == V]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # one sample a step at most, in order
    admitted = [r["admitted"] for r in samples if r["variant"] == V]
    assert admitted == sorted(admitted) and 0 < admitted[-1] <= 2 * 8  # two rounds of a cell of 8 (2 x c)
    assert choice_windows.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "k=auto c=4 |" in out and "k=1 c=4 |" in out
