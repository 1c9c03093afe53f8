"""benchmarks/spec_matrix.py's noise figure: how much "the best fixed k" reads high when every k is as fast,
given how much a cell's runs move between rounds (issue 11's auto / best is read against it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import spec_matrix  # noqa: E402


def test_cells_that_never_move_have_no_noise() -> None:
    assert spec_matrix._noise([[100.0, 100.0, 100.0]] * 5) == (0.0, 0.0)


def test_the_best_of_five_equal_cells_reads_high_by_their_spread() -> None:
    spread, excess = spec_matrix._noise([[90.0, 100.0, 110.0]] * 5)
    assert spread == pytest.approx(0.14826)
    # E[max of 5 standard normals] = 1.163; a median of 3 runs has about 1.2533 / sqrt(3) of a run's spread.
    assert excess == pytest.approx(1.163 * 1.2533 * 0.14826 / 3 ** 0.5, rel=0.02)


def test_one_cell_has_nothing_to_pick_from() -> None:
    spread, excess = spec_matrix._noise([[90.0, 100.0, 110.0]])
    assert spread == pytest.approx(0.14826) and abs(excess) < 0.01
