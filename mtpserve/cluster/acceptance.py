"""Per-request acceptance estimates for adaptive speculation (docs/design.md §9): what the chooser folds into
the expected tokens of each k."""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mtpserve.cluster.spec_config import AdaptiveConfig


class AcceptanceTable:
    """Per-request decayed acceptance per draft position, rows reused as requests come and go.

    Kept transposed ([K, rows]), with each row's cap as a 0/1 mask over positions, so that folding a
    batch for the chooser (`fold`) is a gather, a cumulative product and two sums.

    A step's observations are queued as the scheduler gathers them, (row, drafts, accepted) triples (a
    list append: the host pays per step only that; made an array every step, they took 180 us at 256
    requests on the 2-core CPU), and folded in when the chooser reads the estimates (once per dwell) or
    on `flush`, as one block: each (row, position) moves by the weight its s new observations have
    together, 1 - (1 - decay)^s, toward their mean. That is the one-by-one update where a row's outcomes
    within the block agree, and their average over orders where they differ (a dwell is 8 steps or more, a
    topic changes over a few dozen). The block fold is a few whole-table operations (bincounts of how far
    each observation reached, made per position by a reverse cumulative sum; a [K, observations] mask made
    the fold of a 128-step dwell at 256 requests 10 ms on the 2-core CPU, 5 ms now): on
    the H100's host, where a numpy call costs about 3 us, the exact one-by-one fold took 0.43 ms of a full
    choice (run 168). A row admitted in between starts from the prior of the last fold, and only the
    observations queued after its admission are its own.

    A small block or batch is folded in plain Python instead (`_fold_few`, `_gather_few`): inside the engine,
    between the steps' torch work, each numpy call costs several times what it does in a loop, and a full
    choice's twenty-odd calls took 0.68 ms at 8 requests on the 2-core CPU against 0.2 ms in
    chooser_overhead; a handful of rows and observations cost less one by one.
    """

    # A block of at most FEW_OBSERVATIONS observations, of at most FEW_ROWS requests a step, is folded in plain
    # Python, and a batch of at most FEW_ROWS rows gathered so (about 0.35 us an observation and 10 us a row):
    # at 32 rows the Python paths made a full choice 621 us on the H100's host, against 213 with numpy (runs 193,
    # 188).
    FEW_OBSERVATIONS = 256
    FEW_ROWS = 8
    # How far a request's estimate is shrunk toward the prior is learned (see _add_scores): each candidate strength is
    # scored by how well the shrunk estimates predicted the next observations, over about the last 1 / SCORE_DECAY
    # observations, and the best is used once MIN_SCORED have been scored (config.prior_strength until then).
    STRENGTHS = (1.0, 3.0, 10.0, 30.0, 100.0)
    SCORE_DECAY = 1e-4
    MIN_SCORED = 1000

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        k, rows = max(config.max_k, 1), config.max_rows
        self.prior_list = [config.initial_acceptance] * k  # the engine-wide prior per position, as of the last fold
        self._j = np.arange(k)  # draft positions
        self._width = k + 1  # an observation's reach: 0..K positions
        self.p = np.full((k, rows), config.initial_acceptance)  # [K, rows]
        self.n = np.zeros((k, rows))  # decayed observation counts behind p
        self.within = np.zeros((k, rows))  # 1 where position j + 1 <= the row's cap
        self.adaptive = np.zeros(rows, dtype=bool)
        self.greedy = np.ones(rows, dtype=bool)  # the row's request samples greedily (the step costs' mode)
        self.floor_cap = np.zeros(rows, dtype=np.int64)  # a fixed request's k (0 for adaptive rows)
        self.prior_seen = [0] * k  # observations of each position folded into the prior
        self.now = 0  # steps so far (the chooser counts them)
        self.drafted_at = [0] * k  # the fold that last saw each position, any request
        self._free = list(range(rows - 1, -1, -1))
        self._pending: list[list[tuple[int, int, int]]] = []  # per queued step, (row, drafts, accepted)
        self._owned_from = [0] * rows  # the first queued step that is the row's own
        self._reused = False  # a row was acquired while steps were queued (some may be a former holder's)
        self.strength = config.prior_strength  # the prior's weight, in observations, in what the chooser reads
        self.scores = [0.0] * len(self.STRENGTHS)  # decayed squared errors of each candidate's predictions
        self.scored = 0  # observations scored so far
        self._strengths = np.array(self.STRENGTHS)[:, None]

    @property
    def prior(self) -> np.ndarray:
        """[K] the engine-wide prior per position, as of the last fold."""
        return np.array(self.prior_list)

    def acquire(self, cap: int, adaptive: bool, greedy: bool = True) -> int:
        row = self._free.pop()
        self.greedy[row] = greedy
        self._owned_from[row] = len(self._pending)  # a previous holder's queued steps count for the prior only
        self._reused |= bool(self._pending)
        self.within[:, row] = self._j < cap
        self.adaptive[row], self.floor_cap[row] = adaptive, 0 if adaptive else cap
        self.p[:, row], self.n[:, row] = self.prior_list, 0.0
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def set(self, rows: np.ndarray, p: np.ndarray) -> None:
        """Estimates p [K, n] for rows [n], held as certain (tests: synthetic tables)."""
        self.flush()
        self.p[:, rows], self.n[:, rows] = p, 1e12

    def fold(self, rows: np.ndarray, flush: bool = True) -> tuple[list[float], float, int]:
        """For choose_k: (gains [K]: the adaptive rows' summed prod_{i <= j} p_i up to their caps; base: one
        token per row plus the fixed rows' expected accepted drafts; floor: the largest fixed k). Each row's
        estimate is shrunk toward the prior by its observation count, as if the prior were `strength`
        observations (learned: see _add_scores). flush=False: the estimates as the last flush left them (the
        chooser flushed a few steps ahead: a flush costs about 16 us on the 2-core CPU however few it folds)."""
        if flush:
            self.flush()
        if rows.size <= self.FEW_ROWS:
            return self._gather_few(rows)
        n, s = self.n.take(rows, axis=1), self.strength
        mine = n / np.maximum(n + s, 1e-300)  # strength 0 and no observation: 0, the prior alone
        prior = self.prior[:, None]
        reach = prior + mine * (self.p.take(rows, axis=1) - prior)  # [K, n]
        np.cumprod(reach, axis=0, out=reach)  # prod_{i <= j} p_i
        reach *= self.within.take(rows, axis=1)
        gains = reach @ self.adaptive.take(rows)
        return gains.tolist(), rows.size + float(reach.sum() - gains.sum()), int(self.floor_cap.take(rows).max())

    def _gather_few(self, rows: np.ndarray) -> tuple[list[float], float, int]:
        """fold's result for a few rows, one row at a time in plain Python (see the class)."""
        strength, prior = self.strength, self.prior_list
        gains, base, floor = [0.0] * len(prior), float(rows.size), 0
        p, n, within = self.p, self.n, self.within
        for row in rows.tolist():
            reach, adaptive = 1.0, self.adaptive[row]
            for j, qj in enumerate(prior):
                if not within[j, row]:  # past the row's cap (a prefix of positions is within it)
                    break
                nj = float(n[j, row])
                reach *= qj + nj / max(nj + strength, 1e-300) * (float(p[j, row]) - qj)
                if adaptive:
                    gains[j] += reach
                else:
                    base += reach
            floor = max(floor, int(self.floor_cap[row]))
        return gains, base, floor

    def observe(self, rows: np.ndarray, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """A step verified drafts[i] drafts of row rows[i] (each row once) and accepted accepted[i] of them:
        positions j < accepted were accepted, position `accepted` (when < drafts) rejected, later ones not
        seen. Queued until the next fold."""
        self.observe_step(list(zip(np.asarray(rows).tolist(), np.asarray(drafts).tolist(),
                                   np.asarray(accepted).tolist())))

    def observe_step(self, seen: list[tuple[int, int, int]]) -> None:
        """`observe` as the scheduler gathers a step: (row, drafts, accepted) per request that drafted. Folded
        at once every max_dwell queued steps: the chooser folds them once per dwell while adaptive requests
        run, but no choice is made while only fixed-k ones do, and their queue grew with every step (an
        engine serving fixed k alone held all of them; the next auto cell of the T = 1 matrix folded 190k)."""
        if seen:
            self._pending.append(seen)
            if len(self._pending) >= self.config.max_dwell:
                self.flush()

    def flush(self) -> None:
        """Fold the queued steps into the estimates as one block (see the class)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        owned = None  # per row, its first own queued step (None: every queued step is its row's own)
        if self._reused:
            owned, self._owned_from, self._reused = self._owned_from, [0] * len(self._owned_from), False
        if sum(map(len, pending)) <= self.FEW_OBSERVATIONS and max(map(len, pending)) <= self.FEW_ROWS:
            seen, hit = self._fold_few(pending, owned)
        else:
            seen, hit = self._fold_many(pending, owned)
        self._fold_prior(seen, hit)
        for j, s in enumerate(seen):
            if s:
                self.drafted_at[j] = self.now

    def _fold_few(self, pending: list[list[tuple[int, int, int]]], owned: list[int] | None
                  ) -> tuple[list[int], list[int]]:
        """flush for a small block, in plain Python: each observation counted where it reached, then each
        observed row's positions moved. -> the block's (seen, hit) per position, for the prior."""
        width = self._width
        reached, accepts = [0] * width, [0] * width  # observations reaching / accepting exactly v positions
        rows: dict[int, list[int]] = {}  # per observed row, the same two counts side by side
        for i, step in enumerate(pending):
            for row, drafts, accepted in step:
                reach = accepted + 1 if accepted < drafts else drafts  # saw positions j < reach, hit j < accepted
                reached[reach] += 1
                accepts[accepted] += 1
                if owned is None or i >= owned[row]:
                    counts = rows.get(row) or rows.setdefault(row, [0] * (2 * width))
                    counts[reach] += 1
                    counts[width + accepted] += 1
        cells = [(j, row, s, h) for row, counts in rows.items()
                 for j, (s, h) in enumerate(zip(_tail_list(counts[:width]), _tail_list(counts[width:]))) if s]
        self._score_few(cells)
        keep, full = 1.0 - self.config.decay, 1.0 / self.config.decay
        p, n = self.p, self.n
        for j, row, s, h in cells:  # as _fold_rows, one cell at a time
            moved = 1.0 - keep**s
            p[j, row] += moved * (h / s - p[j, row])
            n[j, row] += moved * (full - n[j, row])
        return _tail_list(reached), _tail_list(accepts)

    def _fold_many(self, pending: list[list[tuple[int, int, int]]], owned: list[int] | None
                   ) -> tuple[list[int], list[int]]:
        """flush for a large block, as whole-table operations (see the class). -> (seen, hit) as _fold_few."""
        sizes = [len(step) for step in pending]
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(pending)), np.int64, 3 * sum(sizes))
        rows, drafts, accepted = flat.reshape(-1, 3).T
        reach = np.minimum(accepted + 1, drafts)  # an observation saw positions j < reach, hit those j < accepted
        width = self._width
        own = None if owned is None else np.repeat(np.arange(len(pending)), sizes) >= np.array(owned)[rows]
        at, size = rows * width, self.p.shape[1] * width  # flat index of (row, reach)
        seen = _tails(np.bincount(at + reach, own, size).reshape(-1, width)).T
        hit = _tails(np.bincount(at + accepted, own, size).reshape(-1, width)).T
        self._score_many(seen, hit)
        self._fold_rows(seen, hit)
        return (_tails(np.bincount(reach, minlength=width)).tolist(),
                _tails(np.bincount(accepted, minlength=width)).tolist())

    def _fold_rows(self, s: np.ndarray, h: np.ndarray) -> None:
        """s [K, rows] observations of each (position, row), h of them hits: p moves by 1 - (1 - d)^s toward
        h / s, and n = (1 - d)^s n + sum_{e < s} (1 - d)^e (what one-by-one updates give for n, in any order)."""
        d = self.config.decay
        moved = 1.0 - (1.0 - d) ** s  # 0 where nothing was seen
        self.p += moved * (h / np.maximum(s, 1.0) - self.p)
        self.n += moved * (1.0 / d - self.n)

    def _score_many(self, s: np.ndarray, h: np.ndarray) -> None:
        """Score each candidate strength on a block: s [K, rows] observations of each (position, row), h of them
        hits, against the estimates before the block (what the chooser read for the steps that made it)."""
        count = int(s.sum())
        if not count:
            return
        cells = (s > 0) & (self.n > 0)  # a new row's estimate is the prior whatever the strength: no score
        seen, hit, n, p = s[cells], h[cells], self.n[cells], self.p[cells]
        q = np.broadcast_to(self.prior[:, None], s.shape)[cells]
        pred = q + n / (n + self._strengths) * (p - q)  # [candidates, cells]
        self._add_scores((hit * (1.0 - pred) ** 2 + (seen - hit) * pred**2).sum(axis=1).tolist(), count)

    def _score_few(self, cells: list[tuple[int, int, int, int]]) -> None:
        """_score_many over (position, row, seen, hit) cells, in plain Python."""
        if not cells:
            return
        errors, prior, count = [0.0] * len(self.STRENGTHS), self.prior_list, 0
        for j, row, s, h in cells:
            n, q = float(self.n[j, row]), prior[j]
            count += s
            if n == 0.0:  # a new row's estimate is the prior whatever the strength: the same error for each
                continue
            # Predicting q + x, x = n / (n + strength) * (p - q): h (1 - q - x)^2 + (s - h) (q + x)^2, quadratic in x.
            level, linear, d = h * (1.0 - q) ** 2 + (s - h) * q * q, 2.0 * (s * q - h), n * (float(self.p[j, row]) - q)
            for c, strength in enumerate(self.STRENGTHS):
                x = d / (n + strength)
                errors[c] += level + x * (linear + s * x)
        self._add_scores(errors, count)

    def _add_scores(self, errors: list[float], count: int) -> None:
        """Fold a block's squared errors (per candidate, over `count` observations) into the decayed scores; the
        best candidate becomes the strength once MIN_SCORED observations were scored.

        Why learned: a request's decayed estimate rests on about 1 / decay observations, and at T = 1 on the H200
        its noise alone sent requests to k = 0 or 1, where nothing more is observed, for 84-734 steps of a c = 1
        cell where k = 2 was best (run 267); where requests do differ, a strong pull toward the prior would
        hide it. Which one holds is what the scores measure."""
        keep = (1.0 - self.SCORE_DECAY) ** count
        self.scores = [score * keep + error for score, error in zip(self.scores, errors)]
        self.scored += count
        if self.scored >= self.MIN_SCORED:
            self.strength = self.STRENGTHS[min(range(len(self.scores)), key=self.scores.__getitem__)]

    def _fold_prior(self, seen: list[int], hits: list[int]) -> None:
        """Each position's prior moves toward the block's mean by the larger of a decayed weight (prior_decay
        per observation) and a plain running mean's (the initial prior counting as prior_weight observations),
        so that the engine-wide figure settles within the first steps, and requests that start from it do
        not run for long at the initial guess."""
        c, prior = self.config, self.prior_list
        for j, (s, h) in enumerate(zip(seen, hits)):  # K positions: plain Python
            if s:
                self.prior_seen[j] += s
                weight = max(1.0 - (1.0 - c.prior_decay) ** s, s / (c.prior_weight + self.prior_seen[j]))
                prior[j] += weight * (h / s - prior[j])


def _tail_list(counts: list[int]) -> list[int]:
    """_tails of one row of counts, in plain Python."""
    left, tails = sum(counts), []
    for count in counts[:-1]:
        left -= count
        tails.append(left)
    return tails


def _tails(counts: np.ndarray) -> np.ndarray:
    """counts [..., K + 1] of observations reaching exactly v = 0..K positions -> [..., K]: those reaching past
    position j (a reverse cumulative sum: position j is seen, or hit, by every observation with v > j). Counting
    values instead of a [K, observations] mask: a dwell of 128 steps at 256 requests folded in 10 ms."""
    return counts.sum(axis=-1, keepdims=True) - np.cumsum(counts, axis=-1)[..., :-1]
