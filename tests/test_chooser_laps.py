"""benchmarks/chooser_laps.py: the chooser's parts timed inside the engine, beside the laps they land in."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import chooser_laps  # noqa: E402


def test_timers_wrap_every_part_and_unwrapping_restores_it() -> None:
    before = [getattr(cls, name) for cls, name in chooser_laps.PARTS]
    timings: chooser_laps.Timings = defaultdict(list)
    untime = chooser_laps.time_parts(timings)
    assert all(getattr(cls, name) is not method for (cls, name), method in zip(chooser_laps.PARTS, before))
    untime()
    assert [getattr(cls, name) for cls, name in chooser_laps.PARTS] == before


def test_a_tiny_run_times_auto_s_choices_and_no_fixed_k_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert chooser_laps.main(["--tiny", "--device", "cpu", "--no-results"]) == 0
    out = capsys.readouterr().out
    laps = {r[0]: r for r in (line.split() for line in out.splitlines()) if r and r[0] in ("MTPauto", "MTP1")
            and len(r) == 10}
    assert int(laps["MTPauto"][4]) > 0 and int(laps["MTPauto"][7]) > 0  # laps, and laps that chose
    assert int(laps["MTP1"][7]) == 0  # a fixed k chooses nothing
    parts = [line.split() for line in out.splitlines() if line.split()[:1] == ["MTPauto"] and len(line.split()) == 8]
    assert any(r[2] == "choose" and int(r[3]) > 0 for r in parts), out
