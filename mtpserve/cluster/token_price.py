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


class TokenPrice:
    """The host's seconds per emitted token (per request): the median of the last DRAWS draws, each the slope of a
    pool of requests' postprocessing seconds over their tokens (None before the first draw: the engine times none
    where AdaptiveConfig.token_price_within_steps is off)."""

    EVERY = 8  # one step in EVERY has its postprocessing timed request by request (clock reads per request)
    POOL = 128  # requests behind one draw: a small batch's timed steps pool theirs (a few hundred steps at c = 1)
    LEAST = 3  # requests at one token count for that count's mean to count
    DRAWS = 9  # draws behind the price (a GC pause or a slow spell inside one pool moves one draw)

    def __init__(self) -> None:
        self.price: float | None = None
        self._steps = 0
        self._pool: list[tuple[int, float]] = []
        self._draws: deque[float] = deque(maxlen=self.DRAWS)

    def due(self) -> bool:
        """Whether the step being postprocessed now is to be timed request by request (counts the step)."""
        self._steps += 1
        return self._steps % self.EVERY == 0

    def add(self, tokens: Sequence[int], seconds: Sequence[float]) -> None:
        """One timed step: per request, the tokens it kept and its share of the step's postprocessing."""
        self._pool.extend(zip(tokens, seconds))
        if len(self._pool) >= self.POOL:
            drawn, self._pool = group_slope(self._pool, self.LEAST), []
            if drawn is not None:
                self.add_draw(drawn)

    def add_draw(self, drawn: float) -> None:
        """A pool's slope (seconds per token): the price is the median of the last DRAWS (a replay feeds these)."""
        self._draws.append(drawn)
        self.price = plain_median(self._draws)


def group_slope(pairs: Sequence[tuple[int, float]], least: int) -> float | None:
    """The slope of seconds over tokens through each token count's mean seconds, weighted by its requests (counts with
    fewer than `least` requests left out); None where fewer than two counts remain (every request kept as many
    tokens: k = 0, or full acceptance), 0 where it slopes down. Means, since a block offered is a request's
    seconds in a few steps out of many; samples over OUTLIER times the pool's median are left out (a GC pause)."""
    cap = OUTLIER * plain_median([seconds for _, seconds in pairs])
    groups: dict[int, list[float]] = {}
    for tokens, seconds in pairs:
        if seconds <= cap:
            groups.setdefault(tokens, []).append(seconds)
    points = [(t, sum(s) / len(s), len(s)) for t, s in groups.items() if len(s) >= least]
    if len(points) < 2:
        return None
    n = sum(w for _, _, w in points)
    mean_t, mean_s = sum(t * w for t, _, w in points) / n, sum(s * w for _, s, w in points) / n
    tt = sum(w * (t - mean_t) ** 2 for t, _, w in points)
    ts = sum(w * (t - mean_t) * (s - mean_s) for t, s, w in points)
    return max(ts / tt, 0.0)
