"""How the host's share of a decode step grows with k, learned where k goes down and back (design §9).

The host's share per request moves with the host's speed (1.4-1.7x between two cells of one run on the
H100's host) and with k itself: at T = 1, c = 256 it was 13.2 / 18.0 / 19.8 / 21.9 / 24.3 us at k = 0..4
(choice trace, session N). A bucket's samples sit almost always at one k (auto dwelling on its choice),
so no window of them shows that growth, and comparing medians of k's timed at different moments reads
the host's drift as the price of k. What is stable is the ratio, the shape: within one run the
relative growth from k = 1 was the same within a few percent at c = 32, 128 and 256.

So the shape is learned from segments A-B-A: a run of steps at k, one at k' (a probe of one dwell, or
any move of the chooser), and the first steps back at k, all in one batch bucket with no other samples
between. log(B) - (log(A's last) + log(A's first back)) / 2 measures log(h(k') / h(k)) with any linear
drift of the host cancelled. Per pair of k the last few such measurements are kept and their median
used; the shape `g` (log host per request at each k, up to a constant) is their least-squares fit, with
a weak pull toward flat between neighbours where nothing was measured. One shape for every bucket.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Segment:
    """A run of consecutive samples of one bucket at one k."""

    k: int
    start: int  # global index of its first sample
    end: int  # global index of its last sample
    first: list[float] = field(default_factory=list)  # log host of its first samples (up to SIDE)
    last: deque = field(default_factory=lambda: deque(maxlen=HostShape.SIDE))  # of its last samples


class HostShape:
    SIDE = 8  # samples of each A compared (the first back, the last before)
    MIN = 4  # samples each of A, B and A back must have
    GAP = 8  # samples of other buckets allowed between two segments (a drain, a ramp: no more)
    KEEP = 5  # measurements kept per pair (their median is the pair's difference)
    SMOOTH = 0.05  # weight of "flat" between unmeasured neighbours, next to one measurement's 1
    STALE = 1024  # samples after which a pair counts as unmeasured again (the chooser probes it)

    def __init__(self, max_k: int, num_buckets: int) -> None:
        self.max_k = max_k
        self.pairs: dict[tuple[int, int], deque[float]] = {}  # (i < j) -> log h(j) / h(i) measurements
        self.measured_at: dict[tuple[int, int], int] = {}  # (i < j) -> sample index of the last one
        self.count = 0  # samples seen, every bucket
        self.hosted = 0  # of them with a host share (an executor that times only its own work gives none)
        self._segments: list[deque[_Segment]] = [deque(maxlen=3) for _ in range(num_buckets)]
        self._g: np.ndarray | None = np.zeros(max_k + 1)  # None: refit before use

    def observe(self, bucket: int, k: int, host_per_request: float) -> None:
        """One timed decode step of `bucket` at k whose host share was `host_per_request` seconds a request."""
        self.count += 1
        if host_per_request <= 0.0:
            return
        self.hosted += 1
        value, segments = float(np.log(host_per_request)), self._segments[bucket]
        now = segments[-1] if segments else None
        if now is None or now.k != k or self.count - now.end > self.GAP + 1:
            if now is not None and (now.end - now.start + 1 < self.MIN or self.count - now.end > self.GAP + 1):
                segments.clear()  # too short to compare, or cut off: A-B-A must be contiguous
            now = _Segment(k, self.count, self.count)
            segments.append(now)
        now.end = self.count
        now.last.append(value)
        if len(now.first) < self.SIDE:
            now.first.append(value)
            if len(now.first) == self.MIN and len(segments) == 3:
                self._measure(*segments)

    def _measure(self, a: _Segment, b: _Segment, back: _Segment) -> None:
        if a.k != back.k or b.k == a.k or b.end - b.start + 1 < self.MIN:
            return
        # As many of A's last samples as of its first back: a drift linear in time then cancels exactly.
        before = list(a.last)[-len(back.first):]
        d = float(np.median(b.first + list(b.last)) - (np.median(before) + np.median(back.first)) / 2)
        i, j = min(a.k, b.k), max(a.k, b.k)
        self.pairs.setdefault((i, j), deque(maxlen=self.KEEP)).append(d if b.k == j else -d)
        self.measured_at[(i, j)] = self.count
        self._g = None

    def measured(self, i: int, j: int) -> bool:
        """Whether the pair (i, j) has a measurement of the last STALE samples (or, with no host share seen
        at all, needs none)."""
        if not self.hosted:
            return True
        at = self.measured_at.get((min(i, j), max(i, j)))
        return at is not None and self.count - at <= self.STALE

    def scale(self) -> np.ndarray:
        """[K + 1] host per request at each k relative to k = 0 (ones before anything was measured)."""
        if self._g is None:
            self._g = self._fit()
        return np.exp(self._g - self._g[0])

    def _fit(self) -> np.ndarray:
        """Least squares g_j - g_i = median of (i, j)'s measurements, weighted by their count, plus a weak
        g_k = g_{k-1} between neighbours never measured (an unmeasured k sits level with its neighbour)."""
        n = self.max_k + 1
        a, rhs = np.zeros((n, n)), np.zeros(n)
        links = [((k - 1, k), self.SMOOTH, 0.0) for k in range(1, n) if (k - 1, k) not in self.pairs]
        links += [(ij, float(len(ds)), float(np.median(ds))) for ij, ds in self.pairs.items()]
        for (i, j), w, d in links:
            a[i, i] += w
            a[j, j] += w
            a[i, j] -= w
            a[j, i] -= w
            rhs[j] += w * d
            rhs[i] -= w * d
        a[0, 0] += 1.0  # g_0 = 0 fixes the constant the differences leave free
        return np.linalg.solve(a, rhs)
