"""The host's price of a draft per batch bucket, as StepCosts draws it (docs/design.md §9): below the MTP modules
from windows that held two k's and from the chooser's A/B/A probes (paired_probe.py), past them (where the chain
reruns the last module) from windows that held only k's there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mtpserve.cluster import host_fits
from mtpserve.cluster.device_costs import lower_median, plain_median
from mtpserve.cluster.paired_probe import SETTLE, SIDE, PairedProbe
from mtpserve.cluster.token_price import TokenPrice


class DraftPriceDraws:
    """StepCosts' part that draws the host's price of a draft. Its state lives on StepCosts, per bucket (a pickled
    model, benchmarks/cost_samples.py, keeps it there): host_draft_slopes, host_recursion_slopes, _draft_draws,
    _recursion_draws, _recursion_probe, _recursion_paired and _probes, beside the host line's own; the prices it
    gives (_draft_prices) are bounded and capped as AdaptiveConfig.bound_recursion and cap_drafts say."""

    # Probes behind the host's price of a draft past the modules (see host_recursion_slopes): at greedy c = 256 on the
    # H200 three drew 4.39, 3.99 and 0 us a request, where the fixed cells' steps put it at about 2 (run 332).
    RECURSION_DRAWS = 5
    bound_recursion = True  # AdaptiveConfig.bound_recursion, set by the chooser
    cap_drafts = True  # AdaptiveConfig.cap_drafts, set by the chooser
    # Probes behind the price of a draft below the modules (each a catch-up): one A/B/A draw is noisy (0, 6.95 and
    # 1.81 us a request at T = 1, c = 8 on the H200, where the fixed cells' steps put it at about 4, run 302).
    DRAFT_DRAWS = 5
    host_recent: list[deque]
    host_slopes: list[float]
    host_draft_slopes: list[float]
    host_recursion_slopes: list[float | None]
    k_seen: list[list[int]]
    _draft_draws: list[deque]
    _recursion_draws: list[deque]
    _recursion_probe: list[int]
    _recursion_paired: list[bool]
    _probes: list[PairedProbe | None]
    # Per bucket, (interruptions so far, k, samples at k in a row since both: the run a probe's before side comes from)
    # as of its last sample; see interrupt.
    _runs: list[tuple[int, int, int]]
    _interruptions: int
    clean_probes = False  # AdaptiveConfig.clean_probes, set by the chooser
    _slopes: list[tuple[float, float, float]]
    _bases: list[float]
    _fitted_at: list[int]
    bucket: Callable[[int], int]  # StepCosts': a batch's bucket
    _draft_price: Callable[[float, float], list[float]]  # StepCosts': [K + 1] the drafts' price at each k
    tokens: TokenPrice  # StepCosts': the host's price of a token drawn within steps

    def knows_recursion(self, batch: int) -> bool:
        """Whether this batch's bucket has drawn the host's price of a draft past the modules."""
        return self.host_recursion_slopes[self.bucket(batch)] is not None

    def knows_draft_price(self, batch: int) -> bool:
        """Whether this batch's bucket has drawn the host's price of a draft below the modules from DRAFT_DRAWS
        probes."""
        return len(self._draft_draws[self.bucket(batch)]) == self.DRAFT_DRAWS

    def interrupt(self, admitted: bool) -> None:
        """An untimed step with prompt chunks (`admitted`: requests joined or recomputed) or catch-ups ran. The host's
        share a request moves around such steps: at T = 1, c = 128 on the H200 the first decode step after an
        admission took 7-8 % more than its neighbours and the next ten 2-8 % less, while a probe's draw looks for
        about 1 % (run 357). A probe whose sides straddle one reads that as the price: the before side taken from the
        bucket's last samples at k, of the previous wave's last steps where the probe opened a new one, drew the fourth
        draft at 1.59 us a request where the fixed cells' k = 3 and 4 differed by their tokens alone. So (clean_probes)
        every bucket's run of samples starts again, a probe under way is void where requests joined, and one whose
        catch-up ran (below the modules, as k rose back) gathers its after side anew past it."""
        if not self.clean_probes:
            return
        self._interruptions += 1
        for b, probe in enumerate(self._probes):
            if probe is None:
                continue
            if admitted:
                self._probes[b] = None
            else:
                probe.restart_after()

    def _count_run(self, b: int, k: int) -> None:
        """Bucket b took a sample at k (StepCosts.observe): its clean run grows, or starts again (SETTLE samples short
        where an interruption came since its last sample)."""
        interruptions, run_k, count = self._runs[b]
        if interruptions != self._interruptions:
            count = -SETTLE
        elif run_k != k:
            count = 0
        self._runs[b] = (self._interruptions, k, count + 1)

    def clean_run(self, batch: int, k: int) -> int:
        """Samples at k this batch's bucket has taken in a row since the last interruption (see interrupt), none
        since: with clean_probes, a probe of k - 1 takes its before side from them."""
        interruptions, run_k, count = self._runs[self.bucket(batch)]
        return max(count, 0) if interruptions == self._interruptions and run_k == k else 0

    def begin_probe(self, batch: int, k: int) -> None:
        """The chooser probes k - 1 from k in this batch's bucket from the next step: its steps, and those at k around
        it, draw the host's price of a draft (paired_probe.py), below the modules or, where k - 1 reaches them all,
        past them. The before side: the bucket's newest SIDE samples at k (with clean_probes, of its clean run)."""
        b = self.bucket(batch)
        side = min(self.clean_run(batch, k), SIDE) if self.clean_probes else SIDE
        before = [(s, e) for s, e, j in reversed(self.host_recent[b]) if j == k][:side]
        self._probes[b] = PairedProbe(k, before)

    def _draw_probe(self, b: int, probe: PairedProbe) -> None:
        """A complete probe's draw, in the line's units (at the host's speed of the line's window, as its other
        terms: divided by the speed the samples around the probe ran at)."""
        drawn = probe.draw(self.host_slopes[b])
        if drawn is None:
            return
        slope, per_draft, recursion = self._slopes[b]  # as the last fit left them (recursion: per_draft until drawn)
        price = self._draft_price(per_draft, recursion)
        around = [(s, e, probe.k) for s, e in probe.before + probe.after]
        speed = plain_median(host_fits.speeds(around, self._bases[b], slope, price)) if self._fitted_at[b] else 1.0
        drawn = drawn / speed if speed > 0 else drawn
        if probe.k > self.modules:  # k - 1 still runs every module: the draft it left out reruns the last one
            self._recursion_paired[b] = True  # windows draw no more; theirs leave as the probes' draws replace them
            self._draw_recursion(b, drawn, None)
            return
        self._draft_draws[b].append(drawn)
        self.host_draft_slopes[b] = plain_median(self._draft_draws[b])

    def _draft_prices(self, b: int) -> tuple[float, float]:
        """(per draft below the modules, per draft past them) of bucket b's host per request, as b drew them (past
        the modules as below them until drawn there; bounded, at most as below them once a window or a probe drew
        that above 0; capped at a token's price). A bucket a drain passes through too fast to draw its own keeps 0
        (docs/adaptive-measurements.md, session AK: borrowing a larger bucket's, tried, moved drain picks to k's whose
        steps ran slower there)."""
        per_draft, recursion = self.host_draft_slopes[b], self.host_recursion_slopes[b]
        cap = self.tokens.price if self.cap_drafts else None
        if cap:  # see AdaptiveConfig.cap_drafts (a token priced 0, as a floored draw can be, caps nothing)
            per_draft = min(per_draft, cap)
        if recursion is None:
            return per_draft, per_draft
        bound = self._recursion_bound(per_draft)
        return per_draft, recursion if bound is None else min(recursion, bound)

    def _recursion_bound(self, per_draft: float) -> float | None:
        """The most a draft past the modules is priced at, given the (capped) price below them: that price where
        bounded, else a token's where capped; None: no bound. Bounded only where a window or a probe drew a price below
        the modules above 0: 0 is also what a bucket holds before any draw and what a floored draw reads, and bounded
        by it a draft past the modules would cost nothing."""
        if self.bound_recursion and per_draft > 0:  # see AdaptiveConfig
            return per_draft
        return self.tokens.price if self.cap_drafts and self.tokens.price else None

    def dearest_recursion(self, b: int) -> float | None:
        """The most bucket b's price of a draft past the modules can stand at, however its probes draw it (line units):
        a token's price where capped (cap_drafts), at most the price below the modules where bounded; None: no bound."""
        return self._recursion_bound(self._draft_prices(b)[0])

    def _draw_recursion(self, b: int, drawn: float, probed: int | None) -> None:
        """A window past the modules drew `drawn` as the price of a draft past them, its lowest k `probed` (None: a
        paired probe drew it, each one a draw of its own): a new draw where that k was sampled since the last draw's
        probe, else the last draw refined; settled (see host_recursion_slopes) at the lower median of the last
        RECURSION_DRAWS."""
        draws, probe = self._recursion_draws[b], -1 if probed is None else self.k_seen[b][probed]
        if draws and probed is not None and self._recursion_probe[b] == probe:
            draws[-1] = drawn
        else:
            draws.append(drawn)
            self._recursion_probe[b] = probe
        if len(draws) == draws.maxlen:
            self.host_recursion_slopes[b] = lower_median(draws)
