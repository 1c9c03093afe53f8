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
    follow their samples and its estimated ones hold.
    """

    REFIT = 256  # a refit is about as costly as the rest of a full choice: every 32 samples it was every 4th

    def __init__(self, max_k: int, buckets: np.ndarray, window: int, per_draft_cost: float) -> None:
        self.window, self.per_draft_cost, self.buckets = window, per_draft_cost, buckets
        shape = (len(buckets), max_k + 1)
        self.seconds = np.full(shape, np.nan)  # medians, where measured
        self.seeds = np.full(shape, np.nan)  # start-up timings
        self.samples = np.zeros(shape, dtype=np.int64)
        self.recent = np.full(shape + (window,), np.nan)  # the last samples, a ring
        self._count = 0
        self._slope = per_draft_cost
        self._table = self._estimate()
        self._stale = np.zeros(len(buckets), dtype=bool)  # rows of _table to estimate again
        self._refit = False  # the slope and every row

    @property
    def known(self) -> bool:
        """Whether any cell was measured or seeded."""
        return bool(self.samples.any()) or not np.isnan(self.seeds).all()

    def observe(self, b: int, k: int, device: float) -> None:
        first = self.samples[b, k] == 0
        self.recent[b, k, self.samples[b, k] % self.window] = device
        self.samples[b, k] += 1
        if first:
            self.seconds[b, k] = device  # marks the cell measured; its median waits for `row`
        self._count += 1
        # A first sample of a seeded cell changes no estimate (the seed stood for it): its row is re-read only.
        # On the GPU every cell is seeded, and a closed loop's drain measured a new cell in each small bucket
        # it passed through: a refit each, up to 5 ms a full choice on the H100's host (run 175).
        self._refit |= bool(first and np.isnan(self.seeds[b, k])) or self._count % self.REFIT == 0
        self._stale[b] = True

    def seed(self, b: int, k: int, seconds: float) -> None:
        self.seeds[b, k] = seconds
        self._refit = True

    def timed(self, b: int, k: int) -> bool:
        return not (np.isnan(self.seconds[b, k]) and np.isnan(self.seeds[b, k]))

    def row(self, b: int) -> np.ndarray:
        """[K + 1] seconds at each k in bucket b (estimated where not measured)."""
        if self._refit:
            self._update_medians(slice(None))
            self._slope, self._table, self._refit = self.slope(), self._estimate(), False
            self._stale[:] = False
        elif self._stale[b]:
            self._update_medians(slice(b, b + 1))
            known = self._known(self.seconds[b : b + 1], self.seeds[b : b + 1])[0]
            self._table[b] = np.where(np.isnan(known), self._table[b], known)
            self._stale[b] = False
        return self._table[b]

    def slope(self) -> float:
        """Relative extra device cost per draft (b / a of cost = a + b k), the median over the buckets where
        two or more k are known; the configured prior before that."""
        a, b, n = _line_fit(self._known(self.seconds, self.seeds))
        rel = np.divide(b, a, out=np.zeros_like(b), where=a > 0)[(n >= 2) & (a > 0)]
        return float(np.clip(_median(rel), 0.0, 10.0)) if rel.size else self.per_draft_cost

    def _update_medians(self, rows: slice) -> None:
        """seconds[rows] = the lower median of each measured cell's recent samples (NaN sorts last)."""
        n = np.minimum(self.samples[rows], self.window)  # [r, K + 1]
        ordered = np.sort(self.recent[rows], axis=-1)
        r, k = np.indices(n.shape, sparse=True)
        self.seconds[rows] = np.where(n > 0, ordered[r, k, (np.maximum(n, 1) - 1) // 2], np.nan)  # NaN: never measured

    @staticmethod
    def _known(seconds: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Measured where measured, else the seed moved by its bucket's mean (measured - seed); NaN elsewhere."""
        both = ~np.isnan(seconds) & ~np.isnan(seeds)
        offset = np.where(both, seconds - seeds, 0.0).sum(axis=1) / np.maximum(both.sum(axis=1), 1)
        return np.where(np.isnan(seconds), seeds + offset[:, None], seconds)

    def _estimate(self, bucket: int | None = None) -> np.ndarray:
        """Known where known; elsewhere the bucket's own line through its known k (two or more), else
        1 + slope * k scaled to its one known cost, or to the nearest bucket's level where it knows none
        (device time grows slowly with the batch; unscaled where no bucket knows any)."""
        known_all = self._known(self.seconds, self.seeds)
        ks = np.arange(known_all.shape[1])
        levels = np.nanmax(np.where(np.isnan(known_all), -np.inf, known_all / (1.0 + self._slope * ks)), axis=1)
        some = np.flatnonzero(~np.isnan(known_all).all(axis=1))
        if some.size:  # each bucket's nearest one with a known k, itself where it has one
            gap = np.abs(np.log(self.buckets[:, None] / self.buckets[some][None, :]))
            levels = levels[some[np.argmin(gap, axis=1)]]
        else:
            levels = np.ones(len(self.buckets))
        rows = slice(None) if bucket is None else slice(bucket, bucket + 1)
        known, level = known_all[rows], levels[rows]
        a, b, n = _line_fit(known)
        fitted = np.where((n >= 2)[:, None], a[:, None] + b[:, None] * ks, level[:, None] * (1.0 + self._slope * ks))
        return np.where(np.isnan(known), fitted, known)


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
        self.modes = {greedy: DeviceCosts(max_k, self.buckets, window, per_draft_cost) for greedy in (True, False)}
        self.host_recent = np.full((len(self.buckets), self.HOST_WINDOW, 3), np.nan)  # (host, tokens, k), any k
        self.host_samples = np.zeros(len(self.buckets), dtype=np.int64)
        # Per bucket, the last slope its window could draw: a window that holds one k alone (auto dwelling on
        # its choice) keeps it, instead of pricing the host of every k alike whatever tokens it would emit
        # (run 66: 0.003-0.007 ms a token drawn from within one cell, against about 0.014 across cells).
        self.host_slopes = np.zeros(len(self.buckets))
        # Per bucket, the host's seconds per request and draft beyond the tokens' (a window that holds two or
        # more k draws it, others keep the last): scheduling, block tables and offers per KV group grow with
        # k itself. At T = 1 on the H100 a step grew 5 us a request and draft at c = 128 and 256 beyond its
        # tokens' price, and priced by tokens alone k = 4 looked best where k = 2 ran 15 % faster (run 124).
        self.host_draft_slopes = np.zeros(len(self.buckets))
        self.overlapped = False  # how the last timed step ran (the engine's mode: the same for every bucket)
        # lap - device of device-bound overlapped laps, a ring per bucket
        self.gap_recent = np.zeros((len(self.buckets), self.GAP_WINDOW))
        self.gap_samples = np.zeros(len(self.buckets), dtype=np.int64)
        # Per (bucket, k), its recent overlapped laps: lap - device where device-bound, NaN where host-bound.
        self.k_laps = np.full((len(self.buckets), max_k + 1, self.K_LAPS), np.nan)
        self.k_lap_samples = np.zeros((len(self.buckets), max_k + 1), dtype=np.int64)
        self._bucket_of = np.searchsorted(self.buckets, np.arange(max_rows + 1))
        self._slopes = np.zeros((len(self.buckets), 2))  # per bucket, (b, c) of its last fit (see _host_fit)
        self._fitted_at = np.zeros(len(self.buckets), dtype=np.int64)  # host_samples at that fit
        self._newest = np.arange(window)

    def bucket(self, batch: int) -> int:
        return int(self._bucket_of[min(batch, len(self._bucket_of) - 1)])

    def observe(self, batch: int, k: int, device: float, host: float = 0.0, overlapped: bool = False,
                tokens: float = 0.0, greedy: bool = True, lap: float = 0.0) -> None:
        """A timed decode step of `batch` requests whose chain ran k drafts and that emitted `tokens`: `device`
        seconds of its own work on the device, `host` seconds of the host's in its `lap` (0: not given);
        `overlapped`: the two ran side by side; `greedy`: every request of the batch was greedy."""
        b = self.bucket(batch)
        self.modes[greedy].observe(b, k, device)
        self.host_recent[b, self.host_samples[b] % self.HOST_WINDOW] = host / max(batch, 1), tokens / max(batch, 1), k
        self.host_samples[b] += 1
        self.overlapped = overlapped
        if overlapped and lap > 0:
            bound = lap - host > self.DEVICE_BOUND * lap
            self.k_laps[b, k, self.k_lap_samples[b, k] % self.K_LAPS] = max(lap - device, 0.0) if bound else np.nan
            self.k_lap_samples[b, k] += 1
            if bound:
                self.gap_recent[b, self.gap_samples[b] % self.GAP_WINDOW] = max(lap - device, 0.0)
                self.gap_samples[b] += 1

    def gap(self, batch: int) -> float:
        """Seconds a device-bound overlapped step of this batch's bucket lasts beyond its device share: the
        nearest bucket's where its own has no such lap (0 before any)."""
        sampled = np.flatnonzero(self.gap_samples)
        if sampled.size == 0:
            return 0.0
        b = self._nearest(sampled, self.bucket(batch))
        return _median(self.gap_recent[b, : min(self.gap_samples[b], self.GAP_WINDOW)])

    def gaps(self, batch: int) -> np.ndarray:
        """[K + 1] the gap priced at each k: the bucket's (see gap), except 0 at a k whose recent laps in the
        bucket were mostly host-bound."""
        b = self.bucket(batch)
        seen = np.minimum(self.k_lap_samples[b], self.K_LAPS)
        bound = np.count_nonzero(~np.isnan(self.k_laps[b]), axis=1)
        return np.where((seen > 0) & (2 * bound < seen), 0.0, self.gap(batch))

    def seed(self, batch: int, k: int, seconds: float, greedy: bool = True) -> None:
        """A start-up timing (a captured graph's replay: device time only) that real steps replace."""
        self.modes[greedy].seed(self.bucket(batch), k, seconds)

    def timed(self, batch: int, k: int, greedy: bool = True) -> bool:
        """Whether k has been measured or seeded in this batch's bucket (and sampling mode)."""
        return self.modes[greedy].timed(self.bucket(batch), k)

    def costs(self, batch: int, tokens: np.ndarray | None = None, greedy: bool = True) -> np.ndarray:
        """[K + 1] seconds of a step at each k for this batch size and sampling mode, emitting tokens[k] tokens
        (None: the host's share as it is now at every k; a unitless prior before any timing)."""
        device, host = self.device(batch, greedy), self.host(batch, tokens)
        return np.maximum(host, device + self.gaps(batch)) if self.overlapped else host + device

    def device(self, batch: int, greedy: bool = True) -> np.ndarray:
        """[K + 1] device seconds of a step at each k (estimated where not measured). A mode that knows nothing
        yet borrows the other's table: seconds of the wrong mode beat a unitless prior next to host seconds."""
        table = self.modes[greedy]
        if not table.known and self.modes[not greedy].known:
            table = self.modes[not greedy]
        return table.row(self.bucket(batch))

    def _nearest(self, candidates: np.ndarray, b: int) -> int:
        """The bucket among `candidates` (indices) closest to bucket b in batch size (by ratio)."""
        return int(candidates[np.argmin(np.abs(np.log(self.buckets[candidates] / self.buckets[b])))])

    def host(self, batch: int, tokens: np.ndarray | float | None = None) -> np.ndarray | float:
        """The host's share of a step in this batch's bucket now, for steps emitting `tokens` (an array: tokens[k]
        at k drafts, each k also priced by its drafts): on the line through its recent samples where they
        vary enough to draw one, else their lower median."""
        if tokens is None:
            return self.host_line(batch)[2]
        a, slope, per_draft, _ = self._host_fit(batch)
        tokens = np.asarray(tokens, dtype=np.float64)
        drafts = np.arange(tokens.shape[0]) if tokens.ndim else 0
        return np.maximum(a + slope * tokens + per_draft * batch * drafts, 0.0)

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
            sampled = np.flatnonzero(self.host_samples)
            if sampled.size == 0:
                return 0.0, 0.0, 0.0, 0.0
            b = self._nearest(sampled, b)
        count = int(self.host_samples[b])
        n = min(count, self.HOST_WINDOW)
        newest = self.host_recent[b, (count - 1 - self._newest[: min(n, self.window)]) % self.HOST_WINDOW]
        now_s, now_e, now_k = newest.T  # per request, the newest `window` samples
        if count - self._fitted_at[b] >= min(self.HOST_REFIT, max(self._fitted_at[b] // 2, 1)):
            self._slopes[b] = self._fit_slopes(b, n, now_s, now_e, now_k)
            self._fitted_at[b] = count
        slope, per_draft = self._slopes[b]
        level = _lower_median(now_s - slope * now_e - per_draft * now_k)
        return level * batch, float(slope), max(float(per_draft), 0.0), _lower_median(now_s) * batch

    def _fit_slopes(self, b: int, n: int, now_s: np.ndarray, now_e: np.ndarray, now_k: np.ndarray
                    ) -> tuple[float, float]:
        """(b, c) of bucket b's host line: drawn from its window of n samples, bounded by its newest ones."""
        seconds, emitted, ks = (self.host_recent[b, :n, i] for i in range(3))
        # The slopes from the whole window (tokens and k vary across it), the level from its newest samples only:
        # the host's speed drifts, and a change must show within a cell's window, not the line's. A window of
        # one k alone (auto dwelling on its choice) keeps the slopes its bucket drew before.
        slope, per_draft = _host_slopes(seconds, emitted, ks, _median(seconds), float(self.host_slopes[b]))
        self.host_slopes[b] = slope = float(self.host_slopes[b]) if slope is None else slope
        self.host_draft_slopes[b] = per_draft = float(self.host_draft_slopes[b]) if per_draft is None else per_draft
        # Nor may the slopes kept from before exceed the host's share now (the level would go negative); medians,
        # since a lap whose host share was clamped at 0 would otherwise zero them.
        slope = min(slope, _median(now_s / np.maximum(now_e, 1e-9)))
        rest = now_s - slope * now_e
        drafted = now_k > 0
        if drafted.any():
            per_draft = min(per_draft, _median(rest[drafted] / now_k[drafted]))
        # Nor may they price a step at k = 0 below HOST_KEPT of the host now: a step's host also schedules,
        # plans and reads back each request whatever it drafts (on the H100, k = 0 kept 0.58 of k = 4's host
        # at c = 8 and 0.54 at T = 1, c = 256). A window of one k cannot tell the level from the slopes, and
        # one that put nearly all of a greedy c = 128 step's host in its tokens and drafts priced k = 4 at
        # 5.8x k = 0: auto ran k = 0, then caught up all 128 requests (run 143).
        saved = _median((slope * np.maximum(now_e - 1.0, 0.0) + per_draft * now_k) / np.maximum(now_s, 1e-12))
        if saved > 1.0 - self.HOST_KEPT:
            scale = (1.0 - self.HOST_KEPT) / saved
            slope, per_draft = slope * scale, per_draft * scale
        return slope, per_draft


def _lower_median(x: np.ndarray) -> float:
    """The lower median of a small 1-D array (the middle one of an odd count)."""
    mid = (x.shape[0] - 1) // 2
    return float(np.partition(x, mid)[mid])


def _median(x: np.ndarray) -> float:
    """np.median of a small 1-D array without NaNs, the same value at a fraction of its cost: a full choice
    takes several, and np.median's checks and wrappers were most of each (about 25 us on the 2-core CPU)."""
    n = x.shape[0]
    if n % 2:
        return float(np.partition(x, n // 2)[n // 2])
    lo, hi = np.partition(x, (n // 2 - 1, n // 2))[n // 2 - 1 : n // 2 + 1]
    return float((lo + hi) / 2.0)


def _host_slope(seconds: np.ndarray, tokens: np.ndarray, median: float) -> float | None:
    """b of host seconds = a + b * tokens by least squares, leaving out stretched samples (over twice the
    median: a GC pause, the OS); None where tokens hardly vary (one k at a large batch: the slope would be
    noise) or the line would cross zero before zero tokens (the host sped up or slowed down between the k's
    in the window: at T = 1, c = 256 on the H100 such a line read -2.4 ms + 0.026 ms a token and held auto
    at k = 0 for a whole round, run 74), 0 where the fit slopes down."""
    keep = seconds <= 2.0 * median
    x, y = tokens[keep], seconds[keep]
    if x.size < 8 or x.std() < 0.05 * max(x.mean(), 1e-9):
        return None
    slope = max(float(np.cov(x, y, bias=True)[0, 1] / x.var()), 0.0)
    return None if y.mean() - slope * x.mean() < 0 else slope


def _host_slopes(seconds: np.ndarray, tokens: np.ndarray, ks: np.ndarray, median: float, kept: float
                 ) -> tuple[float | None, float | None]:
    """(b, c) of host seconds = a + b * tokens + c * k per request, each None where the window cannot draw it.
    One k in the window (or too few samples of a second): b as _host_slope draws it, c None. Two or more:
    c by least squares on what the tokens leave (b from the samples within each k where they vary, else
    the slope kept from before), 0 where the fit slopes down; both None where the line would cross zero
    before zero tokens and drafts (the host sped up or slowed down between the k's in the window). Two k's
    are fitted with sums and bincounts, not np.unique and np.cov: a full choice calls this, and on the 2-core
    CPU those took half again the time of the rest of the cost row."""
    keep = seconds <= 2.0 * median
    x, y, k = tokens[keep], seconds[keep], ks[keep].astype(np.int64)
    counts = np.bincount(k)
    if np.count_nonzero(counts >= 4) < 2:
        return _host_slope(seconds, tokens, median), None
    # Within each k, tokens vary with acceptance alone: their slope there is the tokens' own price.
    per_k = np.maximum(counts, 1)
    x_in, y_in = x - (np.bincount(k, x) / per_k)[k], y - (np.bincount(k, y) / per_k)[k]
    xx = float(x_in @ x_in)
    b = max(float(x_in @ y_in) / xx, 0.0) if xx >= len(x) * (0.05 * max(float(x.mean()), 1e-9)) ** 2 else kept
    rest = y - b * x
    k_c = k - k.mean()
    c = max(float(k_c @ (rest - rest.mean())) / float(k_c @ k_c), 0.0)
    return (None, None) if rest.mean() - c * k.mean() < 0 else (b, c)


def _line_fit(seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, least squares cost = a + b k through the known (non-NaN) entries, b >= 0 (a step never gets
    cheaper with more drafts): (a, b, number of known entries)."""
    known = ~np.isnan(seconds)
    ks = np.where(known, np.arange(seconds.shape[1]), 0.0)
    ys = np.where(known, seconds, 0.0)
    n = known.sum(axis=1)
    sx, sy, sxx, sxy = ks.sum(1), ys.sum(1), (ks * ks).sum(1), (ks * ys).sum(1)
    den = n * sxx - sx * sx
    b = np.clip(np.divide(n * sxy - sx * sy, den, out=np.zeros(len(n)), where=den > 0), 0.0, None)
    a = np.divide(sy - b * sx, n, out=np.ones(len(n)), where=n > 0)
    return a, b, n
