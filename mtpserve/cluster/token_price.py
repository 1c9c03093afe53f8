"""The host's price of an emitted token (docs/design.md §9), drawn within steps: each request's share of the step's
postprocessing (Scheduler.update: its tokens appended, full KV blocks offered to the prefix cache; OutputProcessor:
detokenization, stop strings, logprobs) against the tokens it kept in that step.

Across steps (the least squares of StepCosts' window of host samples) the slope over tokens reads the host's drift
wherever tokens move with it. At T = 1, c = 128 on the H200, windows that held k = 3 alone, whose tokens varied by a
few percent while the host's speed moved by tens, priced a token at 8.6-14 us (fixed k = 3's steps took about 27 us
a request for 2.2 tokens): k = 0 looked a third of k = 3's cost, and auto ran 54 full-batch steps at k = 0 (run 325).
Within one step every request runs at the same host speed, and tokens vary request to request with acceptance.
What this leaves out grows with tokens too, but more slowly: the KV blocks allocated as requests cross them (while
scheduling) and a request's start and end spread over its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from mtpserve.cluster.device_costs import plain_median

OUTLIER = 10.0  # a request's share over this many times the pool's median is a pause of the host, not its work
Step = tuple[Sequence[int], Sequence[float]]  # one timed step: per request, the tokens it kept and its seconds


class TokenPrice:
    """The host's seconds per emitted token (per request): the median of the last DRAWS draws, each the slope of a
    pool of timed steps' requests' postprocessing seconds over their tokens, within each step (None before the first
    draw: the engine times none where AdaptiveConfig.token_price_within_steps is off)."""

    EVERY = 8  # one step in EVERY has its postprocessing timed request by request (clock reads per request)
    POOL = 128  # requests at least behind one draw: one step's at c >= 128, a small batch's timed steps pool theirs
    DRAWS = 9  # draws behind the price (a GC pause or a slow spell inside one pool moves one draw)

    def __init__(self) -> None:
        self.price: float | None = None
        self._steps = 0
        self._pool: list[Step] = []
        self._pooled = 0  # requests in the pool
        self._draws: deque[float] = deque(maxlen=self.DRAWS)

    def due(self) -> bool:
        """Whether the step being postprocessed now is to be timed request by request (counts the step)."""
        self._steps += 1
        return self._steps % self.EVERY == 0

    def add(self, tokens: Sequence[int], seconds: Sequence[float]) -> None:
        """One timed step: per request, the tokens it kept and its share of the step's postprocessing. A step whose
        requests all kept as many tokens (k = 0, or every draft accepted) says nothing of their price."""
        if len(set(tokens)) < 2:
            return
        self._pool.append((tokens, seconds))
        self._pooled += len(tokens)
        if self._pooled >= self.POOL:
            drawn, self._pool, self._pooled = within_step_slope(self._pool), [], 0
            if drawn is not None:
                self.add_draw(drawn)

    def add_draw(self, drawn: float) -> None:
        """A pool's slope (seconds per token): the price is the median of the last DRAWS (a replay feeds these)."""
        self._draws.append(drawn)
        self.price = plain_median(self._draws)


def within_step_slope(steps: Sequence[Step]) -> float | None:
    """The least-squares slope of seconds over tokens within steps: each request's tokens and seconds taken from its
    own step's means, so that steps at different k or host speeds pool only their spread (at a small batch a pool
    spans many steps). Means, not medians: a KV block offered to the prefix cache is a request's seconds in the few
    steps whose tokens fill one. Requests over OUTLIER times the pool's median are left out (a GC pause). None where
    no step's tokens vary; 0 where it slopes down."""
    cap = OUTLIER * plain_median([x for _, seconds in steps for x in seconds])
    tt = ts = 0.0
    for tokens, seconds in steps:
        kept = [(t, x) for t, x in zip(tokens, seconds) if x <= cap]
        if len(kept) < 2:
            continue
        mean_t, mean_x = sum(t for t, _ in kept) / len(kept), sum(x for _, x in kept) / len(kept)
        for t, x in kept:
            tt += (t - mean_t) ** 2
            ts += (t - mean_t) * (x - mean_x)
    return max(ts / tt, 0.0) if tt > 0.0 else None
