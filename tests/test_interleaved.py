"""benchmarks/interleaved.py: auto against fixed k in short cells interleaved round by round, an engine per variant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import interleaved  # noqa: E402


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
    assert all(r[2] == "2" and int(r[3]) == 2 * 16 for r in rows), rows  # two cells of one 16-token request each
    assert float(rows[0][6]) > 0 and rows[1][6] == "-"


def test_rounds_past_the_prompt_pool_reuse_its_rounds() -> None:
    args = interleaved.parse_args(["--tiny", "--workload", "random", "--rounds", "5", "--requests-per-cell", "256"])
    rounds = interleaved.round_prompts(args, vocab=100)
    assert len(rounds) == 5 and all(len(r) == 256 for r in rounds)
    assert rounds[0] != rounds[1] and rounds[2] == rounds[0] and rounds[3] == rounds[1]  # 600 // 256 = 2 distinct
