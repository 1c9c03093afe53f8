"""One ratio pooled over several interleaved runs: each run's NUM over DEN (tok/s summed over its rounds) and their
geometric mean, each with a 90 % interval (rounds resampled with replacement within each run).

Auto over a fixed k moved by 3 % from one GPU run to the next at the same cell (0.962 - 0.994 at random prompts,
c = 128, over runs 354, 357, 359 and 360 on the H200), as much as the change a setting is meant to make: one run cannot tell it
(`AdaptiveConfig.clean_probes` read 0.952 / 0.965 in one run and 0.995 / 0.974 in the next). Pooling runs narrows
the interval where a single run's cannot. Input: `interleaved.py --cells-out PATH` of each run; a pair names its
variants as --ks did (a setting's "on" may be `auto` in one run and `auto:FIELD=1` in the next).

    python benchmarks/pool_cells.py --pair a.json auto 4 --pair b.json auto:clean_probes=1 auto --c 128
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

Cell = tuple[int, float, float]  # (tokens, seconds, acceptance length) of one round's cell


def load_pair(path: str, num: str, den: str, c: str | None) -> tuple[list[Cell], list[Cell]]:
    """The NUM and DEN variants' cells of one run at concurrency c (None: the run's only one)."""
    by_c = json.loads(Path(path).read_text())["cells"]
    if c is None and len(by_c) != 1:
        raise SystemExit(f"{path}: concurrencies {sorted(by_c)}; choose one with --c")
    cells = by_c.get(c if c is not None else next(iter(by_c)))
    if cells is None:
        raise SystemExit(f"{path}: no concurrency {c} (has {sorted(by_c)})")
    missing = [v for v in (num, den) if v not in cells]
    if missing:
        raise SystemExit(f"{path}: no variant {missing} (has {sorted(cells)})")
    return cells[num], cells[den]


def ratio(num: list[Cell], den: list[Cell], rounds: list[int]) -> float:
    """NUM's tok/s over DEN's, summed over these rounds (the two lists hold the same rounds, in order)."""
    a = sum(num[r][0] for r in rounds) / sum(num[r][1] for r in rounds)
    return a / (sum(den[r][0] for r in rounds) / sum(den[r][1] for r in rounds))


def pooled(pairs: list[tuple[list[Cell], list[Cell]]], draws: int = 2000, seed: int = 0
           ) -> tuple[list[tuple[float, float, float]], tuple[float, float, float]]:
    """(per run (ratio, 5th, 95th percentile), the runs' geometric mean likewise), each draw resampling every run's
    rounds with replacement."""
    rng = random.Random(seed)
    every = [list(range(min(len(num), len(den)))) for num, den in pairs]
    point = [ratio(num, den, rounds) for (num, den), rounds in zip(pairs, every)]
    samples: list[list[float]] = [[] for _ in pairs]
    means = []
    for _ in range(draws):
        drawn = [ratio(num, den, [rng.choice(rounds) for _ in rounds]) for (num, den), rounds in zip(pairs, every)]
        for run, value in zip(samples, drawn):
            run.append(value)
        means.append(_geomean(drawn))
    runs = [(p, *_interval(s)) for p, s in zip(point, samples)]
    return runs, (_geomean(point), *_interval(means))


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _interval(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[int(0.05 * len(ordered))], ordered[int(0.95 * len(ordered)) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("CELLS", "NUM", "DEN"),
                   help="a run's --cells-out file and the two variants whose ratio it gives")
    p.add_argument("--c", default=None, help="the concurrency to read (needed where a run has several)")
    args = p.parse_args(argv)
    pairs = [load_pair(path, num, den, args.c) for path, num, den in args.pair]
    runs, (mean, low, high) = pooled(pairs)
    for (path, num, den), (r, lo, hi), (cells, _) in zip(args.pair, runs, pairs):
        print(f"{path}: {num} / {den} = {r:.3f} ({lo:.3f} - {hi:.3f}), {len(cells)} rounds")
    print(f"pooled over {len(runs)} runs (geometric mean): {mean:.3f} ({low:.3f} - {high:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
