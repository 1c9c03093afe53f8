"""What a decode step costs per (batch bucket, k), as the host's share and the device's (docs/design.md §9).

A step costs the host H (schedule, launch, postprocess) and the device D_k (the step's kernels). With
overlapped steps the batch pays max(H, D_k) per step; run one after the other, H + D_k. The two are
kept apart because they behave differently:

* D_k depends on k and hardly moves (DeviceCosts, device_costs.py): per cell, the lower median of its last
  `cost_window` samples (CUDA events around the step on the device; the time inside the executor where it
  runs serially), seeded at start-up by timing the captured graphs, and estimated where neither exists.
* H moves with the host (on the H100's host one op's time moved 2x inside one run) and grows with the
  tokens a step emits (postprocessing is per token: at c = 8 on the H100, 0.73 ms at k = 0 and 1.25 ms
  at k = 4) and with k itself (work per KV group). Per bucket, a line H / batch = a + b * tokens / batch
  + c * k through its last HOST_WINDOW samples at any k (per request: a draining batch moves host and
  tokens together), scaled by the host's speed now (its newest samples over the line), so every k is priced
  with the host as it is now, the tokens that k would emit and its drafts (b from each request's share of a
  step's postprocessing within steps once drawn there, token_price.py; c only where the window held two k, else
  the last c drawn); overlapped, at the mean of max(host, device) over the host's recent speeds.
  Comparing whole-lap medians of cells measured at different times had read k = 4 as 4.4x k = 0 at c = 1
  where the steps were about 1.4x, and auto picked k's that the fixed-k runs beat.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice

import numpy as np

from mtpserve.cluster.device_costs import DeviceCosts, lower_median, plain_median
from mtpserve.cluster import host_fits
from mtpserve.cluster.draft_prices import DraftPriceDraws
from mtpserve.cluster.paired_probe import PairedProbe
from mtpserve.cluster.token_price import TokenPrice
from mtpserve.workers.cuda_graphs import batch_buckets


class StepCosts(DraftPriceDraws):
    """Seconds of a decode step per (batch bucket, k): combine(host now, device at k).

    The device's share is kept per sampling mode (a DeviceCosts for all-greedy batches, one for the others):
    a sampled step's graph runs the rejection sampler and the sampled drafts, at T = 1 on the H100 2 to 3x
    the greedy one at the same k, and a table seeded with greedy timings alone priced the drafts of a
    sampled batch at a fraction of their cost. The host's share is one line per bucket for both.

    Overlapped, a step whose host waited for the device lasts longer than the device's share: its period
    also holds what the timing events leave out (the copy in and state scatter before the first event, the
    host's wake-up after the last). That gap (lap - device, a median over the bucket's recent such laps) is
    added to the device's share, at T = 1, c = 8 on the H100 0.05-0.26 ms (10-24 %); one median for every
    bucket had priced every k at 4 ms after a drain (run 66). Not to a k whose own recent laps were mostly
    host-bound, which is priced at max(host, device): there the gap of k = 3 priced k = 2 at 0.65 ms where its
    steps took 0.59, and auto ran k = 3 at 0.88 of fixed k = 2 (run 178). A k without laps takes the bucket's.

    The device's share is learned only from laps the device ran through: the host waited for it, or the lap
    outlasted the device's share by at most DEVICE_BOUND of itself (and from serial steps). Where the host is the
    slower, the device idles for each launch and its timed share also holds the graph's start: at T = 1, c = 1
    on the H200 k = 2 read 0.384-0.412 ms in host-bound laps against 0.372, and so priced auto ran k = 3 at 0.83
    of fixed k = 2 (runs 255, 264). A host-bound step is priced at the host's share.
    """

    HOST_WINDOW = 64  # host samples per bucket behind its line (more than a cell's: tokens must vary)
    GAP_WINDOW = 64  # device-bound laps behind the gap's median
    K_LAPS = 16  # overlapped laps per (bucket, k) that tell whether its steps are device-bound
    DEVICE_BOUND = 0.1  # a lap is the device's period when the host waited at least this share of it
    HOST_KEPT = 0.5  # the least share of the host per request now that the line keeps at k = 0
    HOST_REFIT = 32  # samples between two fits of a full host window's slopes (its level follows every sample)

    def __init__(self, max_k: int, max_rows: int, window: int = 16, per_draft_cost: float = 0.12,
                 modules: int | None = None) -> None:
        self.max_k, self.window = max_k, window
        self.modules = max_k if modules is None else modules  # MTP modules: past them a draft recurses on the last
        self.buckets = np.array(batch_buckets(max_rows))
        self._sizes = self.buckets.tolist()
        nb = len(self._sizes)
        self.modes = {greedy: DeviceCosts(max_k, self._sizes, window, per_draft_cost) for greedy in (True, False)}
        # Per bucket, (host, tokens, k) per request of its last HOST_WINDOW samples, any k.
        self.host_recent = [deque(maxlen=self.HOST_WINDOW) for _ in range(nb)]
        # Per bucket and batch size, that batch's last `window` samples (see _at_batch).
        self.host_by_batch: list[dict[int, deque]] = [{} for _ in range(nb)]
        self.host_samples = [0] * nb
        # Per bucket, the last slope its window could draw: a window that holds one k alone (auto dwelling on
        # its choice) keeps it, instead of pricing the host of every k alike whatever tokens it would emit
        # (run 66: 0.003-0.007 ms a token drawn from within one cell, against about 0.014 across cells).
        self.host_slopes = [0.0] * nb
        # The host's price of a token as each request's share of a step's postprocessing draws it within steps
        # (token_price.py); once drawn, every bucket's line takes it as its slope instead of drawing one across steps.
        self.tokens = TokenPrice()
        # Per bucket, the host's seconds per request and draft beyond the tokens' (a window that holds two or
        # more k draws it, others keep the last): scheduling, block tables and offers per KV group grow with
        # k itself. At T = 1 on the H100 a step grew 5 us a request and draft at c = 128 and 256 beyond its
        # tokens' price, and priced by tokens alone k = 4 looked best where k = 2 ran 15 % faster (run 124).
        self.host_draft_slopes = [0.0] * nb
        # Per bucket, the host's price per request of a draft past the modules, where a window that held only k's
        # at or past them drew it (auto probing k - 1 there, spec_chooser._probe_down); None: as any draft. Such a
        # draft reruns the last module (no KV group of its own): its price says nothing of a draft below the
        # modules, and extrapolated there it sent auto at T = 1, c = 256 from k = 4 to k = 1 (H100, run 227).
        self.host_recursion_slopes: list[float | None] = [None] * nb
        # Per bucket, that price as the last RECURSION_DRAWS probes drew it (one a probe, refined while its samples
        # stay in the window; their lower median is the price), and the sample count at the last one's probe: drawn
        # from one probe on a drifting host it read 16 us a request where k = 4 ran 7 % faster (run 235).
        self._recursion_draws = [deque(maxlen=self.RECURSION_DRAWS) for _ in range(nb)]
        self._recursion_probe = [-1] * nb
        # Per bucket, whether a paired probe (A/B/A) has drawn that price: windows draw it only until then (their draws
        # already made leave the median as the probes' replace them: a majority of RECURSION_DRAWS outvotes them).
        # Through a window that held k = 3 and 4 the host's drift read as up to 4.9 us a request for the fourth draft
        # at T = 1, c = 256 on the H200, where fixed k = 4's steps took less host than k = 3's (run 326).
        self._recursion_paired = [False] * nb
        # Per bucket, the price of a draft below the modules as the last DRAFT_DRAWS probes drew it, each A/B/A
        # (paired_probe.py; host_draft_slopes is their median, a window's draw before the first): no window drew it
        # where auto dwelt on one k (run 300), and those that held two read the host's speed changes (run 301).
        self._draft_draws = [deque(maxlen=self.DRAFT_DRAWS) for _ in range(nb)]
        self._probes: list[PairedProbe | None] = [None] * nb
        self._runs, self._interruptions = [(0, -1, 0)] * nb, 0  # clean runs of samples (DraftPriceDraws.interrupt)
        self.overlapped = False  # how the last timed step ran (the engine's mode: the same for every bucket)
        self.gap_recent = [deque(maxlen=self.GAP_WINDOW) for _ in range(nb)]  # lap - device of device-bound laps
        self.gap_samples = [0] * nb
        # Per (bucket, k), whether each of its recent overlapped laps was device-bound.
        self.k_laps = [[deque(maxlen=self.K_LAPS) for _ in range(max_k + 1)] for _ in range(nb)]
        self._bucket_of = np.searchsorted(self.buckets, np.arange(max_rows + 1)).tolist()
        self._slopes = [(0.0, 0.0, 0.0)] * nb  # per bucket, (b, c, c past the modules) of its last fit
        self._bases = [0.0] * nb  # per bucket, the level a of its last fit (per request, at the window's speed)
        self._fitted_at = [0] * nb  # host_samples at that fit
        self.k_seen = [[0] * (max_k + 1) for _ in range(nb)]  # per (bucket, k): host_samples at its last sample
        # (greedy, bucket, k) that ran only laps where the device idled: timed, though the device's cell has no sample
        self._idle_timed: set[tuple[bool, int, int]] = set()

    def bucket(self, batch: int) -> int:
        return self._bucket_of[min(batch, len(self._bucket_of) - 1)]

    def observe(self, batch: int, k: int, device: float, host: float = 0.0, overlapped: bool = False,
                tokens: float = 0.0, greedy: bool = True, lap: float = 0.0) -> None:
        """A timed decode step of `batch` requests whose chain ran k drafts and that emitted `tokens`: `device`
        seconds of its own work on the device, `host` seconds of the host's in its `lap` (0: not given);
        `overlapped`: the two ran side by side; `greedy`: every request of the batch was greedy. Plain Python:
        the engine pays it every step."""
        b, per = self.bucket(batch), max(batch, 1)
        sample = (host / per, tokens / per, k)
        self.host_recent[b].append(sample)
        same = self.host_by_batch[b].get(batch)
        if same is None:
            same = self.host_by_batch[b][batch] = deque(maxlen=self.window)
        same.append(sample)
        self.host_samples[b] += 1
        self.k_seen[b][k] = self.host_samples[b]
        self._count_run(b, k)
        probe = self._probes[b]
        if probe is not None and (done := probe.add(k, host / per, tokens / per)) is not None:
            self._probes[b] = None
            if done:
                self._draw_probe(b, probe)
        self.overlapped = overlapped
        busy = True  # whether the device ran the lap through (a serial step's device share is its own)
        if overlapped and lap > 0:
            bound = lap - host > self.DEVICE_BOUND * lap
            self.k_laps[b][k].append(bound)
            if bound:
                self.gap_recent[b].append(max(lap - device, 0.0))
                self.gap_samples[b] += 1
            busy = bound or lap - device <= self.DEVICE_BOUND * lap
        if busy:  # see the class: where the device idled for the host, its share reads high
            self.modes[greedy].observe(b, k, device)
        else:
            self._idle_timed.add((greedy, b, k))

    def gap(self, batch: int) -> float:
        """Seconds a device-bound overlapped step of this batch's bucket lasts beyond its device share: the
        nearest bucket's where its own has no such lap (0 before any)."""
        sampled = [b for b, n in enumerate(self.gap_samples) if n]
        return plain_median(self.gap_recent[self._nearest(sampled, self.bucket(batch))]) if sampled else 0.0

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
        """Whether k has been measured or seeded in this batch's bucket (and sampling mode). A k whose laps were all
        host-bound was measured too: the chooser need not time it again (AdaptiveSpec._explore)."""
        b = self.bucket(batch)
        return self.modes[greedy].timed(b, k) or (greedy, b, k) in self._idle_timed

    def costs(self, batch: int, tokens: np.ndarray | list[float] | None = None, greedy: bool = True,
              refit: bool = True, recursion: float | None = None) -> np.ndarray:
        """[K + 1] seconds of a step at each k for this batch size and sampling mode, emitting tokens[k] tokens
        (None: the host's share as it is now at every k; a unitless prior before any timing). refit=False: the
        host line as last fitted, even where a refit is due (newcomers' choices, whose prefill step runs alone).
        recursion: the host's price of a draft past the modules (line units) instead of the bucket's own."""
        device, fit, gaps = self._device(batch, greedy), self._host_fit(batch, refit, recursion), self._gaps(batch)
        if tokens is None:
            host, spread = [fit[3]] * len(device), [1.0]
        else:
            host, spread = self._host(batch, fit, tokens), fit[4]
        if self.overlapped:  # a lap lasts the longer of the two: its mean, over the host's recent speeds
            return np.array(host_fits.means_of_max(host, [d + g for d, g in zip(device, gaps)], spread))
        mean_spread = sum(spread) / len(spread)
        return np.array([h * mean_spread + d for h, d in zip(host, device)])

    def dearest_costs(self, batch: int, tokens: np.ndarray | list[float], greedy: bool = True) -> np.ndarray | None:
        """costs() with each draft past the modules priced at the most its price can stand at (dearest_recursion),
        the host line as last fitted; None where nothing bounds that price (no token price drawn, nothing below) or
        the line was never fitted."""
        b = self._sampled_bucket(batch)
        dearest = None if b is None or not self._fitted_at[b] else self.dearest_recursion(b)
        if dearest is None:
            return None
        return self.costs(batch, tokens, greedy, refit=False, recursion=dearest)

    def refit(self, batch: int) -> None:
        """Fit the host line of this batch's bucket again where that is due (see _host_fit): a step ahead of a full
        choice (AdaptiveSpec._prepare), whose own step then does not pay for it."""
        b = self._sampled_bucket(batch)
        if b is not None:
            self._refit(b)

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
            a, slope, *_ = self._host_fit(batch)
            return max(a + slope * float(tokens), 0.0)
        return np.array(self._host(batch, self._host_fit(batch), tokens))

    def _host(self, batch: int, fit: tuple, tokens: np.ndarray | list[float]) -> list[float]:
        """host() at tokens[k] emitted by a step of k drafts, k = 0.."""
        a, slope, price, *_ = fit
        emitted = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        return [max(a + slope * t + batch * price[k], 0.0) for k, t in enumerate(emitted)]

    def host_line(self, batch: int) -> tuple[float, float, float]:
        """(a, b, median) of the host's share of a step of `batch` requests at k = 0: seconds = a + b * tokens
        (see _host_fit), and the lower median of the bucket's recent samples, scaled to this batch."""
        a, slope, _, median, _ = self._host_fit(batch)
        return a, slope, median

    def one_k_run(self, batch: int, k: int) -> int:
        """Host samples in a row this batch's bucket has taken at k alone (all of them where it never saw another
        k): a window that holds one k cannot draw the host's price of a draft (see host_draft_slopes)."""
        b = self.bucket(batch)
        return self.host_samples[b] - max((n for j, n in enumerate(self.k_seen[b]) if j != k), default=0)

    def draft_price_moot(self, batch: int, k: int, greedy: bool = True) -> bool:
        """Whether the host's price of a draft can move neither k's cost nor k - 1's in this batch's bucket: each of
        k's last K_LAPS overlapped laps was device-bound, and the host's share of them (their median) stays under
        the device's share at k - 1, which fewer drafts and tokens on the host cannot then exceed; or the host's
        share of k's steps is nil (steps timed without it)."""
        b = self.bucket(batch)
        hosts = [s for s, _, j in self.host_recent[b] if j == k]
        if hosts and plain_median(hosts) == 0.0:
            return True
        laps = self.k_laps[b][k]
        if k < 1 or len(laps) < self.K_LAPS or not all(laps):
            return False
        return bool(hosts) and plain_median(hosts) * max(batch, 1) < self._device(batch, greedy)[k - 1]

    def host_draft_prices(self, batch: int) -> list[float]:
        """[K + 1] the host's seconds per request for k drafts in this batch's bucket, beyond their tokens'."""
        return self._host_fit(batch)[2]

    def host_per_draft(self, batch: int) -> float:
        """The host's seconds per request and draft in this batch's bucket, beyond what its tokens cost."""
        return self._host_fit(batch)[2][min(1, self.max_k)]

    def _draft_price(self, per_draft: float, recursion: float) -> list[float]:
        """[K + 1] the host's seconds per request for k drafts: per_draft each up to the modules, recursion past."""
        m = self.modules
        return [per_draft * min(k, m) + recursion * max(k - m, 0) for k in range(self.max_k + 1)]

    def _host_fit(self, batch: int, refit: bool = True, recursion: float | None = None
                  ) -> tuple[float, float, list[float], float, list[float]]:
        """(a, b, price, median, spread): seconds = a + b * tokens + batch * price[k], price[k] = c * k (c past the
        modules where drawn there: see host_recursion_slopes). The line is drawn per request (host / batch against
        tokens / batch and k): through the raw pairs of a draining batch it had read 0.014 ms a token from above
        -1.8 ms at c = 256, pricing k = 0 best (run 69). A bucket without samples borrows the nearest sampled
        bucket's line, scaled to its own batch the same way (device time alone would price drafts as if the host
        were free). Zeros before any sample.

        The host's speed (and the median) follow the newest samples at every call (see _at_batch); the line itself,
        its level and slopes drawn from the bucket's whole window, is fitted again only once its samples have grown
        by half since the last fit, or by HOST_REFIT: a fit was most of a full choice's host time (about 0.4 ms of
        1.1 on the H100's host, run 168). The speed scales the whole line (host_fits.speeds).

        spread: each newest sample's speed over the speed now (their lower median), at most 2. A step lasts the
        longer of host and device: where the two are close, every slow host lap is a slow step (at T = 1, c = 1 on
        the H100, priced at medians k = 0 and 2 looked 5 % apart where k = 2 ran 12 % faster, run 238)."""
        b = self._sampled_bucket(batch)
        if b is None:
            return 0.0, 0.0, [0.0] * (self.max_k + 1), 0.0, [1.0]
        if refit:
            self._refit(b)
        newest = self._at_batch(b, batch) or self._newest(b)
        (slope, per_draft, drawn), base = self._slopes[b], self._bases[b]
        recursion = drawn if recursion is None else recursion
        price = [max(p, 0.0) for p in self._draft_price(per_draft, recursion)]
        speeds = host_fits.speeds(newest, base, slope, price)
        speed = lower_median(speeds)
        spread = [min(v / speed, 2.0) for v in speeds] if speed > 0 else [1.0]
        return (base * speed * batch, slope * speed, [p * speed for p in price],
                lower_median([s for s, _, _ in newest]) * batch, spread)

    def _at_batch(self, b: int, batch: int) -> list[tuple[float, float, int]]:
        """Bucket b's newest `window` samples taken at this very batch size, the newest first, where there are at
        least half as many (else none): the host's speed is read from them. A step's host has a part per step
        besides the part per request (at T = 1, c = 8 on the H200 about 0.22 ms + 0.033 ms a request), which the
        line, drawn per request, spreads over the batch: a drain's steps of 5 requests read 82 us a request where
        full ones read 61. Read from them, the speed priced the next cell's first choices at 1.27x k = 2's real
        laps, every k at the same host level, and auto ran k = 4 for 62 % of each cell's first 50 steps (run 305).
        Kept apart from the bucket's window, which a drain can fill (at c = 8, 64 steps of 5 requests, run 308)."""
        same = self.host_by_batch[b].get(batch, ())
        return list(reversed(same)) if 2 * len(same) >= self.window else []

    def _refit(self, b: int) -> None:
        """Bucket b's line fitted again where that is due (see _host_fit)."""
        count = self.host_samples[b]
        if count - self._fitted_at[b] >= min(self.HOST_REFIT, max(self._fitted_at[b] // 2, 1)):
            slope, per_draft, recursion = self._slopes[b] = self._fit_slopes(b, self._newest(b))
            price = self._draft_price(per_draft, recursion)
            self._bases[b] = max(lower_median([s - slope * e - price[k] for s, e, k in self.host_recent[b]]), 0.0)
            self._fitted_at[b] = count

    def _newest(self, b: int) -> list[tuple[float, float, int]]:
        """Bucket b's newest `window` samples (per request: host seconds, tokens, k), the newest first."""
        return list(islice(reversed(self.host_recent[b]), self.window))

    def _sampled_bucket(self, batch: int) -> int | None:
        """This batch's bucket, or where it has no host sample the nearest one that has (None: none has)."""
        b = self.bucket(batch)
        if self.host_samples[b] == 0:
            sampled = [i for i, n in enumerate(self.host_samples) if n]
            return self._nearest(sampled, b) if sampled else None
        return b

    def _fit_slopes(self, b: int, newest: list[tuple[float, float, int]]) -> tuple[float, float, float]:
        """(b, c, c past the modules) of bucket b's host line: drawn from its window, bounded by its newest
        samples (per request: host seconds, tokens, k). Plain Python over at most HOST_WINDOW samples: inside
        the engine, numpy's calls made a refit 0.35-0.45 ms on the 2-core CPU."""
        seconds, emitted, ks = zip(*self.host_recent[b])
        # The slopes from the whole window (tokens and k vary across it), the level from its newest samples only:
        # the host's speed drifts, and a change must show within a cell's window, not the line's. A window of
        # one k alone (auto dwelling on its choice) keeps the slopes its bucket drew before.
        m, recursion = self.modules, self.host_recursion_slopes[b]
        past = min(ks) >= m  # a window past the modules draws the price of a recursion's draft alone
        units = [k - m for k in ks] if past else ks
        if not past and recursion is not None:  # k's on both sides: the drafts past the modules at their own price
            seconds = tuple(s - recursion * max(k - m, 0) for s, k in zip(seconds, ks))
            units = [min(k, m) for k in ks]
        slope, drawn = host_fits.host_slopes(seconds, emitted, units, plain_median(seconds), self.host_slopes[b],
                                             self.tokens.price)
        self.host_slopes[b] = slope = self.host_slopes[b] if slope is None else slope
        if drawn is not None and past:
            if not self._recursion_paired[b]:
                self._draw_recursion(b, drawn, min(ks))
        elif drawn is not None and not self._draft_draws[b]:  # a probe's draw outweighs any window's
            self.host_draft_slopes[b] = drawn
        per_draft, recursion = self._draft_prices(b)
        return host_fits.within_host(slope, per_draft, recursion, newest, self._draft_price, self.HOST_KEPT)
