"""Device seconds of a decode step per (batch bucket, k), for batches of one sampling mode (docs/design.md §9):
the lower median of each cell's recent samples, start-up seeds, and a line through a bucket's known k where a k
is neither measured nor seeded. StepCosts (step_costs.py) keeps one table per sampling mode beside the host's line.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import numpy as np


class DeviceCosts:
    """Device seconds of a decode step per (batch bucket, k), for batches of one sampling mode.

    Cells: the lower median of recent samples, not an average: steps are stretched now and then (a GC
    pause, the OS) and a few end early, and the median ignores any minority of them at once where an
    average clipped to 1.5x of itself recovered from one bad first sample by a few percent a step.
    Start-up seeds (a captured graph's replay) are kept apart from measured cells: where a bucket has
    both at some k, its seeds are moved by their mean difference (the measured step also holds its
    copies), so that a seeded k is compared with a measured one on the same footing. A k neither
    measured nor seeded lies on the bucket's least-squares line through its known k (two or more), else
    on 1 + s k scaled to its one known cost, s being the median relative slope of the buckets that have
    a line (`per_draft_cost` before any).

    A measurement only marks what it changes: the bucket's row, or the whole table (the fitted slope)
    when a cell without a seed is first measured and every `REFIT` samples after; `row` estimates what is
    marked when the chooser asks (once per dwell, not every step). Between refits a row's measured cells
    follow their samples and its estimated ones hold. A step's sample, a row's update and the whole table's
    refit are plain Python over a few floats: inside the engine each numpy call on the chooser's cold path cost
    5-8 us (a full choice about 1 ms on the 2-core CPU, against 0.5 ms in a loop).
    """

    REFIT = 256  # a refit is about as costly as the rest of a full choice: every 32 samples it was every 4th

    def __init__(self, max_k: int, sizes: list[int], window: int, per_draft_cost: float) -> None:
        self.window, self.per_draft_cost = window, per_draft_cost
        self._sizes = sizes  # each bucket's batch size
        buckets = range(len(sizes))
        self._seeds = [[math.nan] * (max_k + 1) for _ in buckets]  # start-up timings
        self._recent = [[deque(maxlen=window) for _ in range(max_k + 1)] for _ in buckets]  # each cell's last samples
        self._counts = [[0] * (max_k + 1) for _ in buckets]
        self._count = 0
        self._slope = per_draft_cost
        self._table: list[list[float]] = self._estimate(self._known_table())
        self._stale = [False] * len(buckets)  # rows of _table to estimate again
        self._refit = False  # the slope and every row

    @property
    def seeds(self) -> np.ndarray:
        """[buckets, K + 1] start-up timings (NaN: none)."""
        return np.array(self._seeds)

    @property
    def samples(self) -> np.ndarray:
        """[buckets, K + 1] samples taken per cell."""
        return np.array(self._counts)

    @property
    def known(self) -> bool:
        """Whether any cell was measured or seeded."""
        return self._count > 0 or any(s == s for row in self._seeds for s in row)  # s == s: not NaN

    def observe(self, b: int, k: int, device: float) -> None:
        cell = self._recent[b][k]
        if not cell:
            # A first sample of a seeded cell changes no estimate (the seed stood for it): its row is re-read only.
            # On the GPU every cell is seeded, and a closed loop's drain measured a new cell in each small bucket
            # it passed through: a refit each, up to 5 ms a full choice on the H100's host (run 175).
            self._refit |= self._seeds[b][k] != self._seeds[b][k]  # NaN: no seed
        cell.append(device)
        self._counts[b][k] += 1
        self._count += 1
        self._refit |= self._count % self.REFIT == 0
        self._stale[b] = True

    def seed(self, b: int, k: int, seconds: float) -> None:
        self._seeds[b][k] = seconds
        self._refit = True

    def timed(self, b: int, k: int) -> bool:
        return bool(self._recent[b][k]) or self._seeds[b][k] == self._seeds[b][k]

    def row(self, b: int) -> list[float]:
        """[K + 1] seconds at each k in bucket b (estimated where not measured)."""
        if self._refit:
            known = self._known_table()
            # The estimate is drawn with the slope of the refit before, as it always was (a tuple assignment
            # hid the order); drawn with the new one it changes the chooser's choices, not yet measured on a GPU.
            self._table, self._refit = self._estimate(known), False
            self._slope = self.slope(known)
            self._stale = [False] * len(self._sizes)
        elif self._stale[b]:
            known_row = self._known_row(b)
            self._table[b] = [t if x != x else x for t, x in zip(self._table[b], known_row)]
            self._stale[b] = False
        return self._table[b]

    def slope(self, known: list[list[float]]) -> float:
        """Relative extra device cost per draft (b / a of cost = a + b k) in the known table [buckets][K + 1], the
        median over the buckets where two or more k are known; the configured prior before that."""
        rel = [b / a for a, b, n in map(_line_fit, known) if n >= 2 and a > 0]
        return min(max(plain_median(rel), 0.0), 10.0) if rel else self.per_draft_cost

    def _known_row(self, b: int) -> list[float]:
        """Bucket b's [K + 1]: the lower median of each measured cell's recent samples, else its seed moved by
        the bucket's mean (measured - seed) over the cells that have both; NaN elsewhere."""
        medians = [lower_median(cell) if cell else math.nan for cell in self._recent[b]]
        seeds = self._seeds[b]
        moved = [m - d for m, d in zip(medians, seeds) if m == m and d == d]  # x == x: not NaN
        offset = sum(moved) / len(moved) if moved else 0.0
        return [d + offset if m != m else m for m, d in zip(medians, seeds)]

    def _known_table(self) -> list[list[float]]:
        return [self._known_row(b) for b in range(len(self._sizes))]

    def _estimate(self, known_all: list[list[float]]) -> list[list[float]]:
        """Known where known (known_all [buckets][K + 1], NaN elsewhere); elsewhere the bucket's own line through
        its known k (two or more), else 1 + slope * k scaled to its one known cost, or to the nearest bucket's
        level where it knows none (device time grows slowly with the batch; unscaled where no bucket knows any).
        Plain Python over the table's few dozen cells (numpy's calls cost a refit 0.6-0.9 ms inside the engine
        on the 2-core CPU)."""
        slope, sizes = self._slope, self._sizes
        some = [b for b, row in enumerate(known_all) if any(x == x for x in row)]  # x == x: not NaN
        table = []
        for b, row in enumerate(known_all):
            a, per_draft, n = _line_fit(row)
            if n < 2:  # no line of its own: the level of its nearest bucket with a known k (itself where it has one)
                near = known_all[min(some, key=lambda c: abs(math.log(sizes[b] / sizes[c])))] if some else []
                level = max((x / (1.0 + slope * k) for k, x in enumerate(near) if x == x), default=1.0)
                a, per_draft = level, level * slope
            table.append([a + per_draft * k if x != x else x for k, x in enumerate(row)])
        return table


def lower_median(values: Sequence[float] | np.ndarray) -> float:
    """The lower median of a few values (the middle one of an odd count)."""
    ordered = sorted(values.tolist() if isinstance(values, np.ndarray) else values)
    return float(ordered[(len(ordered) - 1) // 2])


def plain_median(values: Sequence[float] | np.ndarray) -> float:
    """The median of a few values without NaNs: sorted in Python, not np.median, whose checks and wrappers
    were most of its cost (about 25 us on the 2-core CPU; a full choice takes several)."""
    ordered = sorted(values.tolist() if isinstance(values, np.ndarray) else values)
    n, mid = len(ordered), len(ordered) // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _line_fit(seconds: list[float]) -> tuple[float, float, int]:
    """Least squares cost = a + b k through the known (non-NaN) entries of one row, b >= 0 (a step never gets
    cheaper with more drafts): (a, b, number of known entries)."""
    points = [(k, y) for k, y in enumerate(seconds) if y == y]  # y == y: not NaN
    n = len(points)
    sx, sy = sum(k for k, _ in points), sum(y for _, y in points)
    sxx, sxy = sum(k * k for k, _ in points), sum(k * y for k, y in points)
    den = n * sxx - sx * sx
    b = max((n * sxy - sx * sy) / den, 0.0) if den > 0 else 0.0
    return ((sy - b * sx) / n if n else 1.0), b, n
