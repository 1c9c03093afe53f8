"""benchmarks/spec_matrix.py's noise figure (how much "the best fixed k" reads high when every k is as fast, given
how much a cell's runs move between rounds: issue 11's auto / best is read against it), and its rounds, run again
where the host changed speed during one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import common  # noqa: E402
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


def test_auto_is_paired_round_by_round_with_the_best_fixed_k_by_median() -> None:
    """k = 2 has the best median; auto's rounds are read against k = 2's same rounds, each shown."""
    def runs(*rates: float) -> list[SimpleNamespace]:
        return [SimpleNamespace(tokens_per_s=r) for r in rates]

    table = {1: runs(100.0, 90.0, 80.0), 2: runs(110.0, 100.0, 60.0), spec_matrix.AUTO: runs(99.0, 100.0, 66.0)}
    assert spec_matrix._paired_ratios(table, [1, 2]) == "1.000 (k = 2; rounds 0.900 1.000 1.100)"


def _rounds(probes: list[float], retries: int) -> tuple[dict, list[str], list[str]]:
    """measure_rounds over a driver that records each cell it runs, the host probe reading `probes` in turn."""
    ran: list[str] = []

    def drive(jobs: list, c: int, prefix: str) -> str:
        ran.append(prefix)
        return prefix

    args = argparse.Namespace(repeats=2, steady_retries=retries, steady_host=0.15, max_tokens=4, pin_cpu="auto",
                              grpc=None, http=None)
    readings = iter(probes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec_matrix, "pinnable", lambda *_: True)
        mp.setattr(spec_matrix.host, "pin_cpu", lambda choice: "driving thread pinned to core 3")
        mp.setattr(spec_matrix.host, "host_probe", lambda: next(readings))
        runs, notes = spec_matrix.measure_rounds(drive, lambda k, n, t: [], [0, "auto"], 8, 16, args,
                                                 torch.device("cuda"))
    return runs, notes, ran


def test_a_round_whose_host_changed_speed_runs_again() -> None:
    steady, slowed = [2.5, 2.6, 2.5], [2.5, 4.2, 4.3]  # probes before each of the two cells and after the last
    runs, notes, ran = _rounds(slowed + steady + steady, retries=3)
    assert ran == ["k0c8r0a0", "kautoc8r0a0", "k0c8r0a1", "kautoc8r0a1", "kautoc8r1a0", "k0c8r1a0"]
    assert runs == {0: ["k0c8r0a1", "k0c8r1a0"], "auto": ["kautoc8r0a1", "kautoc8r1a0"]}
    assert "attempt 2" in notes[0] and "2.50-2.60 ms" in notes[0] and "attempt" not in notes[1]


def test_a_round_runs_at_most_its_retries_again() -> None:
    slowed = [2.5, 4.2, 4.3]
    runs, notes, ran = _rounds(slowed * 2 + [2.5, 2.5, 2.5], retries=1)
    assert runs[0] == ["k0c8r0a1", "k0c8r1a0"] and len(ran) == 6
    assert "2.50-4.30 ms (attempt 2)" in notes[0]


@pytest.mark.parametrize("n", [2, 5, 6])
def test_the_balanced_order_puts_every_k_once_in_every_position(n: int) -> None:
    rounds = [common.balanced_order(list(range(n)), r) for r in range(n)]
    assert all(sorted(order) == list(range(n)) for order in rounds)
    assert all(sorted(order[i] for order in rounds) == list(range(n)) for i in range(n))


def test_the_balanced_order_puts_every_k_right_after_every_other_once() -> None:
    """The matrix's six cells: auto no longer always follows k = 4 (a rotation ran it right after k = 4 each round)."""
    ks = [0, 1, 2, 3, 4, spec_matrix.AUTO]
    rounds = [common.balanced_order(ks, r) for r in range(len(ks))]
    pairs = [(a, b) for order in rounds for a, b in zip(order, order[1:])]
    assert len(set(pairs)) == len(pairs) == len(ks) * (len(ks) - 1)
    assert sum(order.index(spec_matrix.AUTO) < order.index(4) for order in rounds) == 3


def test_each_round_notes_its_cells_in_order_with_their_rates(capsys: pytest.CaptureFixture[str]) -> None:
    """... and prints the note as the round ends, so that a run cut short still shows the rounds it made."""
    def drive(jobs: list, c: int, prefix: str) -> SimpleNamespace:
        return SimpleNamespace(tokens_per_s=1000.0 if prefix.startswith("k0") else 2000.0)

    args = argparse.Namespace(repeats=2, steady_retries=0, steady_host=0.15, max_tokens=4, pin_cpu="none",
                              grpc=None, http=None)
    _, notes = spec_matrix.measure_rounds(drive, lambda k, n, t: [], [0, "auto"], 8, 16, args, torch.device("cpu"))
    assert notes[0].endswith("in order, tok/s: 0 1000, auto 2000")
    assert notes[1].endswith("in order, tok/s: auto 2000, 0 1000")
    assert capsys.readouterr().out.splitlines() == notes


def test_a_round_starts_only_where_the_last_ones_time_fits_the_budget() -> None:
    """Each cell takes a second of a fake clock: two rounds of two cells fit a deadline 5 s away, a third would not."""
    clock = [0.0]

    def drive(jobs: list, c: int, prefix: str) -> SimpleNamespace:
        clock[0] += 1.0
        return SimpleNamespace(tokens_per_s=1000.0)

    args = argparse.Namespace(repeats=4, steady_retries=0, steady_host=0.15, max_tokens=4, pin_cpu="none",
                              grpc=None, http=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec_matrix.time, "monotonic", lambda: clock[0])
        runs, notes = spec_matrix.measure_rounds(drive, lambda k, n, t: [], [0, "auto"], 8, 16, args,
                                                 torch.device("cpu"), deadline=5.0)
    assert [len(r) for r in runs.values()] == [2, 2] and clock[0] == 4.0
    assert notes[-1] == "c=8: 2 of 4 rounds, the next would not fit --budget-s"
