"""What a decode step costs per (batch bucket, k), as the host's share and the device's (docs/design.md §9).

A step costs the host H (schedule, launch, postprocess) and the device D_k (the step's kernels). With
overlapped steps the batch pays max(H, D_k) per step; run one after the other, H + D_k. The two are
kept apart because they behave differently:

* D_k depends on k and hardly moves: per cell, the lower median of its last `cost_window` samples
  (CUDA events around the step on the device; the time inside the executor where it runs serially),
  seeded at start-up by timing the captured graphs, and estimated where neither exists.
* H moves with the host (on the H100's host one op's time moved 2x inside one run) and grows with the
  tokens a step emits (postprocessing is per token: at c = 8 on the H100, 0.73 ms at k = 0 and 1.25 ms
  at k = 4) and with k itself (work per KV group). Per bucket, a line H / batch = a + b * tokens / batch
  + c * k through its last HOST_WINDOW samples at any k (per request: a draining batch moves host and
  tokens together), so every k is priced with the host as it is now, the tokens that k would emit and
  its drafts (c only where the window held two k, else the last c drawn). Comparing whole-lap
  medians of cells measured at different times had read k = 4 as 4.4x k = 0 at c = 1 where the steps
  were about 1.4x, and auto picked k's that the fixed-k runs beat.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from itertools import islice
from typing import Sequence

import numpy as np

from mtpserve.workers.cuda_graphs import batch_buckets


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
        return min(max(_median(rel), 0.0), 10.0) if rel else self.per_draft_cost

    def _known_row(self, b: int) -> list[float]:
        """Bucket b's [K + 1]: the lower median of each measured cell's recent samples, else its seed moved by
        the bucket's mean (measured - seed) over the cells that have both; NaN elsewhere."""
        medians = [_lower_median(cell) if cell else math.nan for cell in self._recent[b]]
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


class StepCosts:
    """Seconds of a decode step per (batch bucket, k): combine(host now, device at k).

    The device's share is kept per sampling mode (a DeviceCosts for all-greedy batches, one for the others):
    a sampled step's graph runs the rejection sampler and the sampled drafts, at T = 1 on the H100 2 to 3x
    the greedy one at the same k, and a table seeded with greedy timings alone priced the drafts of a
    sampled batch at a fraction of their cost. The host's share is one line per bucket for both.

    Overlapped, a step whose host waited for the device lasts longer than the device's share: its period
    also holds what the timing events leave out (the step's copy in and state scatter before the first
    event, the host's wake-up after the last). That gap is learned from such laps (lap - device, a
    median over the recent ones of the batch's bucket) and added to the device's share: at T = 1, c = 8
    on the H100 the laps exceeded max(host, device) by 0.05-0.26 ms (10-24 %), about the same at every
    device-bound k. One median for every bucket read 3.7 ms at c = 8 after a closed loop had drained
    through small batches (step_costs.py, run 66), and priced every k at 4 ms there. Nor is it added to a k
    whose own recent laps were mostly host-bound: at T = 1, c = 8 the bucket's gap, 0.165 ms from k = 3's
    device-bound laps, priced host-bound k = 2 steps at 0.65 ms where they took 0.59, k = 3 looked as good,
    and auto ran it for half its steps at 0.88 of fixed k = 2 (run 178). Such a k is priced at
    max(host, device); a k with no recent lap of its own takes the bucket's gap.
    """

    HOST_WINDOW = 64  # host samples per bucket behind its line (more than a cell's: tokens must vary)
    GAP_WINDOW = 64  # device-bound laps behind the gap's median
    K_LAPS = 16  # overlapped laps per (bucket, k) that tell whether its steps are device-bound
    DEVICE_BOUND = 0.1  # a lap is the device's period when the host waited at least this share of it
    HOST_KEPT = 0.5  # the least share of the host per request now that the line keeps at k = 0
    HOST_REFIT = 32  # samples between two fits of a full host window's slopes (its level follows every sample)

    def __init__(self, max_k: int, max_rows: int, window: int = 16, per_draft_cost: float = 0.12) -> None:
        self.max_k, self.window = max_k, window
        self.buckets = np.array(batch_buckets(max_rows))
        self._sizes = self.buckets.tolist()
        nb = len(self._sizes)
        self.modes = {greedy: DeviceCosts(max_k, self._sizes, window, per_draft_cost) for greedy in (True, False)}
        # Per bucket, (host, tokens, k) per request of its last HOST_WINDOW samples, any k.
        self.host_recent = [deque(maxlen=self.HOST_WINDOW) for _ in range(nb)]
        self.host_samples = [0] * nb
        # Per bucket, the last slope its window could draw: a window that holds one k alone (auto dwelling on
        # its choice) keeps it, instead of pricing the host of every k alike whatever tokens it would emit
        # (run 66: 0.003-0.007 ms a token drawn from within one cell, against about 0.014 across cells).
        self.host_slopes = [0.0] * nb
        # Per bucket, the host's seconds per request and draft beyond the tokens' (a window that holds two or
        # more k draws it, others keep the last): scheduling, block tables and offers per KV group grow with
        # k itself. At T = 1 on the H100 a step grew 5 us a request and draft at c = 128 and 256 beyond its
        # tokens' price, and priced by tokens alone k = 4 looked best where k = 2 ran 15 % faster (run 124).
        self.host_draft_slopes = [0.0] * nb
        self.overlapped = False  # how the last timed step ran (the engine's mode: the same for every bucket)
        self.gap_recent = [deque(maxlen=self.GAP_WINDOW) for _ in range(nb)]  # lap - device of device-bound laps
        self.gap_samples = [0] * nb
        # Per (bucket, k), whether each of its recent overlapped laps was device-bound.
        self.k_laps = [[deque(maxlen=self.K_LAPS) for _ in range(max_k + 1)] for _ in range(nb)]
        self._bucket_of = np.searchsorted(self.buckets, np.arange(max_rows + 1)).tolist()
        self._slopes = [(0.0, 0.0)] * nb  # per bucket, (b, c) of its last fit (see _host_fit)
        self._fitted_at = [0] * nb  # host_samples at that fit

    def bucket(self, batch: int) -> int:
        return self._bucket_of[min(batch, len(self._bucket_of) - 1)]

    def observe(self, batch: int, k: int, device: float, host: float = 0.0, overlapped: bool = False,
                tokens: float = 0.0, greedy: bool = True, lap: float = 0.0) -> None:
        """A timed decode step of `batch` requests whose chain ran k drafts and that emitted `tokens`: `device`
        seconds of its own work on the device, `host` seconds of the host's in its `lap` (0: not given);
        `overlapped`: the two ran side by side; `greedy`: every request of the batch was greedy. Plain Python:
        the engine pays it every step."""
        b, per = self.bucket(batch), max(batch, 1)
        self.modes[greedy].observe(b, k, device)
        self.host_recent[b].append((host / per, tokens / per, k))
        self.host_samples[b] += 1
        self.overlapped = overlapped
        if overlapped and lap > 0:
            bound = lap - host > self.DEVICE_BOUND * lap
            self.k_laps[b][k].append(bound)
            if bound:
                self.gap_recent[b].append(max(lap - device, 0.0))
                self.gap_samples[b] += 1

    def gap(self, batch: int) -> float:
        """Seconds a device-bound overlapped step of this batch's bucket lasts beyond its device share: the
        nearest bucket's where its own has no such lap (0 before any)."""
        sampled = [b for b, n in enumerate(self.gap_samples) if n]
        return _median(self.gap_recent[self._nearest(sampled, self.bucket(batch))]) if sampled else 0.0

    def gaps(self, batch: int) -> np.ndarray:
        """[K + 1] the gap priced at each k: the bucket's (see gap), except 0 at a k whose recent laps in the
        bucket were mostly host-bound."""
        return np.array(self._gaps(batch))

    def _gaps(self, batch: int) -> list[float]:
        gap = self.gap(batch)
        return [0.0 if laps and 2 * sum(laps) < len(laps) else gap for laps in self.k_laps[self.bucket(batch)]]

    def seed(self, batch: int, k: int, seconds: float, greedy: bool = True) -> None:
        """A start-up timing (a captured graph's replay: device time only) that real steps replace."""
        self.modes[greedy].seed(self.bucket(batch), k, seconds)

    def timed(self, batch: int, k: int, greedy: bool = True) -> bool:
        """Whether k has been measured or seeded in this batch's bucket (and sampling mode)."""
        return self.modes[greedy].timed(self.bucket(batch), k)

    def costs(self, batch: int, tokens: np.ndarray | None = None, greedy: bool = True) -> np.ndarray:
        """[K + 1] seconds of a step at each k for this batch size and sampling mode, emitting tokens[k] tokens
        (None: the host's share as it is now at every k; a unitless prior before any timing)."""
        device = self._device(batch, greedy)
        host = [self.host_line(batch)[2]] * len(device) if tokens is None else self._host(batch, tokens)
        if self.overlapped:
            return np.array([max(h, d + g) for h, d, g in zip(host, device, self._gaps(batch))])
        return np.array([h + d for h, d in zip(host, device)])

    def device(self, batch: int, greedy: bool = True) -> np.ndarray:
        """[K + 1] device seconds of a step at each k (estimated where not measured)."""
        return np.array(self._device(batch, greedy))

    def _device(self, batch: int, greedy: bool) -> list[float]:
        """A mode that knows nothing yet borrows the other's table: seconds of the wrong mode beat a unitless
        prior next to host seconds."""
        table = self.modes[greedy]
        if not table.known and self.modes[not greedy].known:
            table = self.modes[not greedy]
        return table.row(self.bucket(batch))

    def _nearest(self, candidates: list[int], b: int) -> int:
        """The bucket among `candidates` (indices) closest to bucket b in batch size (by ratio)."""
        return min(candidates, key=lambda c: abs(math.log(self._sizes[c] / self._sizes[b])))

    def host(self, batch: int, tokens: np.ndarray | float | None = None) -> np.ndarray | float:
        """The host's share of a step in this batch's bucket now, for steps emitting `tokens` (an array: tokens[k]
        at k drafts, each k also priced by its drafts): on the line through its recent samples where they
        vary enough to draw one, else their lower median."""
        if tokens is None:
            return self.host_line(batch)[2]
        if np.ndim(tokens) == 0:
            a, slope, _, _ = self._host_fit(batch)
            return max(a + slope * float(tokens), 0.0)
        return np.array(self._host(batch, tokens))

    def _host(self, batch: int, tokens: np.ndarray | list[float]) -> list[float]:
        """host() at tokens[k] emitted by a step of k drafts, k = 0.."""
        a, slope, per_draft, _ = self._host_fit(batch)
        per_draft *= batch
        emitted = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        return [max(a + slope * t + per_draft * k, 0.0) for k, t in enumerate(emitted)]

    def host_line(self, batch: int) -> tuple[float, float, float]:
        """(a, b, median) of the host's share of a step of `batch` requests at k = 0: seconds = a + b * tokens
        (see _host_fit), and the lower median of the bucket's recent samples, scaled to this batch."""
        a, slope, _, median = self._host_fit(batch)
        return a, slope, median

    def host_per_draft(self, batch: int) -> float:
        """The host's seconds per request and draft in this batch's bucket, beyond what its tokens cost."""
        return self._host_fit(batch)[2]

    def _host_fit(self, batch: int) -> tuple[float, float, float, float]:
        """(a, b, c, median): seconds = a + b * tokens + c * batch * k. The line is drawn per request
        (host / batch against tokens / batch and k): within one bucket a draining batch moves host and tokens
        together, and a line through the raw pairs had read 0.014 ms a token from above -1.8 ms at c = 256
        (run 69), pricing k = 0 best. A bucket without samples (one a batch passes through while it ramps
        up) borrows the nearest sampled bucket's line, scaled to its own batch the same way: the host's share
        grows with the requests it handles, and a row of device time alone would price drafts as if the
        host were free. Zeros before any sample.

        The level a (and the median) follow the bucket's newest samples at every call; the slopes b and c,
        drawn from its whole window, are fitted again only once the bucket's samples have grown by half
        since the last fit, or by HOST_REFIT: a fit is most of a full choice's host time (about 0.4 ms of
        1.1 on the H100's host, run 168), half a window moves it little, and a small bucket that a
        draining batch passes through would otherwise fit at every choice."""
        b = self.bucket(batch)
        if self.host_samples[b] == 0:
            sampled = [i for i, n in enumerate(self.host_samples) if n]
            if not sampled:
                return 0.0, 0.0, 0.0, 0.0
            b = self._nearest(sampled, b)
        count = self.host_samples[b]
        newest = list(islice(reversed(self.host_recent[b]), self.window))  # per request, the newest samples
        if count - self._fitted_at[b] >= min(self.HOST_REFIT, max(self._fitted_at[b] // 2, 1)):
            self._slopes[b] = self._fit_slopes(b, newest)
            self._fitted_at[b] = count
        slope, per_draft = self._slopes[b]
        level = _lower_median([s - slope * e - per_draft * k for s, e, k in newest])
        return level * batch, slope, max(per_draft, 0.0), _lower_median([s for s, _, _ in newest]) * batch

    def _fit_slopes(self, b: int, newest: list[tuple[float, float, int]]) -> tuple[float, float]:
        """(b, c) of bucket b's host line: drawn from its window, bounded by its newest samples (per request: host
        seconds, tokens, k). Plain Python over at most HOST_WINDOW samples: inside the engine, numpy's calls
        made a refit 0.35-0.45 ms on the 2-core CPU."""
        seconds, emitted, ks = zip(*self.host_recent[b])
        # The slopes from the whole window (tokens and k vary across it), the level from its newest samples only:
        # the host's speed drifts, and a change must show within a cell's window, not the line's. A window of
        # one k alone (auto dwelling on its choice) keeps the slopes its bucket drew before.
        slope, per_draft = _host_slopes(seconds, emitted, ks, _median(seconds), self.host_slopes[b])
        self.host_slopes[b] = slope = self.host_slopes[b] if slope is None else slope
        self.host_draft_slopes[b] = per_draft = self.host_draft_slopes[b] if per_draft is None else per_draft
        # Nor may the slopes kept from before exceed the host's share now (the level would go negative); medians,
        # since a lap whose host share was clamped at 0 would otherwise zero them.
        slope = min(slope, _median([s / max(e, 1e-9) for s, e, _ in newest]))
        drafted = [(s - slope * e) / k for s, e, k in newest if k > 0]
        if drafted:
            per_draft = min(per_draft, _median(drafted))
        # Nor may they price a step at k = 0 below HOST_KEPT of the host now: a step's host also schedules,
        # plans and reads back each request whatever it drafts (on the H100, k = 0 kept 0.58 of k = 4's host
        # at c = 8 and 0.54 at T = 1, c = 256). A window of one k cannot tell the level from the slopes, and
        # one that put nearly all of a greedy c = 128 step's host in its tokens and drafts priced k = 4 at
        # 5.8x k = 0: auto ran k = 0, then caught up all 128 requests (run 143).
        saved = _median([(slope * max(e - 1.0, 0.0) + per_draft * k) / max(s, 1e-12) for s, e, k in newest])
        if saved > 1.0 - self.HOST_KEPT:
            scale = (1.0 - self.HOST_KEPT) / saved
            slope, per_draft = slope * scale, per_draft * scale
        return slope, per_draft


def _lower_median(values: Sequence[float] | np.ndarray) -> float:
    """The lower median of a few values (the middle one of an odd count)."""
    ordered = sorted(values.tolist() if isinstance(values, np.ndarray) else values)
    return float(ordered[(len(ordered) - 1) // 2])


def _median(values: Sequence[float] | np.ndarray) -> float:
    """The median of a few values without NaNs: sorted in Python, not np.median, whose checks and wrappers
    were most of its cost (about 25 us on the 2-core CPU; a full choice takes several)."""
    ordered = sorted(values.tolist() if isinstance(values, np.ndarray) else values)
    n, mid = len(ordered), len(ordered) // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _host_slope(seconds: Sequence[float], tokens: Sequence[float], median: float) -> float | None:
    """b of host seconds = a + b * tokens by least squares, leaving out stretched samples (over twice the
    median: a GC pause, the OS); None where tokens hardly vary (one k at a large batch: the slope would be
    noise) or the line would cross zero before zero tokens (the host sped up or slowed down between the k's
    in the window: at T = 1, c = 256 on the H100 such a line read -2.4 ms + 0.026 ms a token and held auto
    at k = 0 for a whole round, run 74), 0 where the fit slopes down. Plain Python, as all the host line's fits:
    a window holds at most HOST_WINDOW samples."""
    kept = [(x, y) for x, y in zip(tokens, seconds) if y <= 2.0 * median]
    if len(kept) < 8:
        return None
    mean_x, mean_y = sum(x for x, _ in kept) / len(kept), sum(y for _, y in kept) / len(kept)
    xx = sum((x - mean_x) ** 2 for x, _ in kept)
    if math.sqrt(xx / len(kept)) < 0.05 * max(mean_x, 1e-9):
        return None
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in kept) / xx, 0.0)
    return None if mean_y - slope * mean_x < 0 else slope


def _host_slopes(seconds: Sequence[float], tokens: Sequence[float], ks: Sequence[int], median: float, kept: float
                 ) -> tuple[float | None, float | None]:
    """(b, c) of host seconds = a + b * tokens + c * k per request, each None where the window cannot draw it.
    One k in the window (or too few samples of a second): b as _host_slope draws it, c None. Two or more:
    c by least squares on what the tokens leave (b from the samples within each k where they vary, else
    the slope kept from before), 0 where the fit slopes down; both None where the line would cross zero
    before zero tokens and drafts (the host sped up or slowed down between the k's in the window)."""
    samples = [(x, y, k) for x, y, k in zip(tokens, seconds, ks) if y <= 2.0 * median]
    count, sum_x, sum_y = Counter(), Counter(), Counter()
    for x, y, k in samples:
        count[k] += 1
        sum_x[k] += x
        sum_y[k] += y
    if sum(n >= 4 for n in count.values()) < 2:
        return _host_slope(seconds, tokens, median), None
    # Within each k, tokens vary with acceptance alone: their slope there is the tokens' own price.
    inside = [(x - sum_x[k] / count[k], y - sum_y[k] / count[k]) for x, y, k in samples]
    xx, mean_x = sum(x * x for x, _ in inside), sum(sum_x.values()) / len(samples)
    b = max(sum(x * y for x, y in inside) / xx, 0.0) if xx >= len(samples) * (0.05 * max(mean_x, 1e-9)) ** 2 else kept
    rest = [(y - b * x, k) for x, y, k in samples]
    mean_rest, mean_k = sum(r for r, _ in rest) / len(rest), sum(k for _, k in rest) / len(rest)
    c = max(sum((k - mean_k) * (r - mean_rest) for r, k in rest) / sum((k - mean_k) ** 2 for _, k in rest), 0.0)
    return (None, None) if mean_rest - c * mean_k < 0 else (b, c)


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
