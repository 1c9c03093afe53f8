"""benchmarks/catch_up_steps.py on the CPU's tiny model: a forced fall and rise of k is caught up in full, spread over
several steps by the token budget, and none of them takes the general path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import catch_up_steps  # noqa: E402


def test_a_forced_rise_is_caught_up_over_several_steps_within_the_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert catch_up_steps.main(["--tiny", "--device", "cpu", "--no-results"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith(("first", "again"))}
    assert set(rows) == {"first", "again"}
    for name, (steps, rewound, positions, longest, median, general, captured) in rows.items():
        assert int(rewound) == 4, (name, rows[name])  # --tiny: four requests, every one caught up
        assert int(steps) > 1 and int(positions) > 32, (name, rows[name])  # more than one budget's worth, spread
        assert int(general) == 0 and float(longest) > 0 and float(median) > 0, (name, rows[name])
