"""benchmarks/pool_cells.py: a ratio pooled over several interleaved runs' cells (interleaved.py --cells-out)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import interleaved  # noqa: E402
import pool_cells  # noqa: E402


def _run(path: Path, rates: dict[str, list[float]], c: str = "8") -> str:
    """A --cells-out file whose variants made these tok/s round by round (1000 tokens a cell)."""
    cells = {v: [[1000, 1000 / rate, 2.0] for rate in per_round] for v, per_round in rates.items()}
    path.write_text(json.dumps({"commit": "abc", "cells": {c: cells}}))
    return str(path)


def test_each_run_and_their_geometric_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _run(tmp_path / "a.json", {"auto": [90.0, 90.0, 90.0], "4": [100.0, 100.0, 100.0]})
    b = _run(tmp_path / "b.json", {"auto:x=1": [110.0, 110.0], "auto": [100.0, 100.0]})
    assert pool_cells.main(["--pair", a, "auto", "4", "--pair", b, "auto:x=1", "auto"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("auto / 4 = 0.900 (0.900 - 0.900), 3 rounds")
    assert out[1].endswith("auto:x=1 / auto = 1.100 (1.100 - 1.100), 2 rounds")
    assert out[2] == f"pooled over 2 runs (geometric mean): {math.sqrt(0.99):.3f} ({math.sqrt(0.99):.3f} - " \
                     f"{math.sqrt(0.99):.3f})"


def test_the_interval_comes_from_the_rounds_of_each_run() -> None:
    num = [(1000, 1000 / rate, 2.0) for rate in (80.0, 120.0, 90.0, 110.0)]
    den = [(1000, 10.0, 2.0)] * 4  # 100 tok/s every round
    runs, (mean, low, high) = pool_cells.pooled([(num, den)], draws=500)
    assert runs[0][0] == pytest.approx(mean) and low < mean < high
    assert 0.8 <= low and high <= 1.2


def test_a_missing_variant_or_concurrency_is_named(tmp_path: Path) -> None:
    a = _run(tmp_path / "a.json", {"auto": [90.0], "4": [100.0]})
    with pytest.raises(SystemExit, match=r"no variant \['3'\]"):
        pool_cells.main(["--pair", a, "auto", "3"])
    with pytest.raises(SystemExit, match="no concurrency 16"):
        pool_cells.main(["--pair", a, "auto", "4", "--c", "16"])


def test_interleaved_writes_every_variants_cells_per_round(tmp_path: Path) -> None:
    path = tmp_path / "cells.json"
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,auto", "--concurrency", "2", "--rounds", "2",
                             "--max-tokens", "8", "--no-results", "--cells-out", str(path)]) == 0
    cells = json.loads(path.read_text())["cells"]["2"]
    assert sorted(cells) == ["1", "auto"]
    assert all(len(rounds) == 2 and all(tokens > 0 and seconds > 0 for tokens, seconds, _ in rounds)
               for rounds in cells.values())
    num, den = pool_cells.load_pair(str(path), "auto", "1", None)
    assert len(num) == len(den) == 2
