"""The host line's fits (docs/design.md §9): least squares over one bucket's window of host samples, and the mean
cost of a step over the host's recent speeds. Plain Python over at most StepCosts.HOST_WINDOW samples: a full
choice runs on the host's critical path, and inside the engine each numpy call on this cold path cost several
microseconds (step_costs.py uses them)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate

from mtpserve.cluster.device_costs import plain_median


def means_of_max(host: list[float], floors: list[float], spread: list[float]) -> list[float]:
    """Per k, the mean over the host's recent speeds q (spread) of max(host[k] * q, floors[k]): the speeds in order
    and their tail sums once, then a bisection per k (a full choice runs on the host's critical path)."""
    ordered, n = sorted(spread), len(spread)
    tails = list(accumulate(reversed(ordered), initial=0.0))[::-1]  # tails[i]: the sum of ordered[i:]
    means = []
    for h, floor in zip(host, floors):
        i = bisect_right(ordered, floor / h) if h > 0 else n  # speeds at which the host's share is the shorter
        means.append((floor * i + h * tails[i]) / n)
    return means


def speeds(newest: list[tuple[float, float, int]], base: float, slope: float, price: list[float]) -> list[float]:
    """Per sample (per request: host seconds, tokens, k), its host share over what the line (base + slope * tokens
    + price[k]) gives: the host's speed then, relative to the line's window. A slower host is slower at every
    part of a step (on the H100 every host phase of a cell moved alike, run 77), so the speed scales the line's
    level, tokens and drafts together. Added to the level alone, as until 1ee090a, a slowdown while auto dwelt
    at k = 4 also charged k = 2 the slowed part of k = 4's tokens and drafts, and a slowdown at k = 2 spared
    k = 4 the slowed part of its own: at T = 1, c = 8 the host slowed 2x, auto went to k = 4 and stayed there
    (runs 239 and 242)."""
    return [s / max(base + slope * e + price[k], 1e-12) for s, e, k in newest]


def host_slope(seconds: Sequence[float], tokens: Sequence[float], median: float) -> float | None:
    """b of host seconds = a + b * tokens by least squares, leaving out stretched samples (over twice the
    median: a GC pause, the OS); None where tokens hardly vary (one k at a large batch: the slope would be
    noise) or the line would cross zero before zero tokens (the host sped up or slowed down between the k's
    in the window: at T = 1, c = 256 on the H100 such a line read -2.4 ms + 0.026 ms a token and held auto
    at k = 0 for a whole round, run 74), 0 where the fit slopes down. Plain Python, as all the host line's fits:
    a window holds at most HOST_WINDOW samples."""
    kept = [(x, y) for x, y in zip(tokens, seconds) if y <= 2.0 * median]
    n = len(kept)
    if n < 8:
        return None
    sx = sy = 0.0  # plain loops, not generator sums: a refit runs on the host's critical path (see prepare)
    for x, y in kept:
        sx += x
        sy += y
    mean_x, mean_y = sx / n, sy / n
    xx = xy = 0.0
    for x, y in kept:
        dx = x - mean_x
        xx += dx * dx
        xy += dx * (y - mean_y)
    if math.sqrt(xx / n) < 0.05 * max(mean_x, 1e-9):
        return None
    slope = max(xy / xx, 0.0)
    return None if mean_y - slope * mean_x < 0 else slope


def host_slopes(seconds: Sequence[float], tokens: Sequence[float], ks: Sequence[int], median: float, kept: float,
                token_price: float | None = None) -> tuple[float | None, float | None]:
    """(b, c) of host seconds = a + b * tokens + c * k per request, each None where the window cannot draw it.
    b is `token_price` where one was drawn within steps (token_price.py), else drawn here. One k in the window
    (or too few samples of a second): b as host_slope draws it, c None. Two or more: c by least squares on what
    the tokens leave (b from the samples within each k where they vary, else the slope kept from before), 0 where
    the fit slopes down; c None (and b too where drawn here) where the line would cross zero before zero tokens
    and drafts (the host sped up or slowed down between the k's in the window)."""
    samples = [(x, y, k) for x, y, k in zip(tokens, seconds, ks) if y <= 2.0 * median]
    width = max(ks, default=0) + 1  # k's index plain lists: Counters made most of a refit's time
    count, sum_x, sum_y = [0] * width, [0.0] * width, [0.0] * width
    for x, y, k in samples:
        count[k] += 1
        sum_x[k] += x
        sum_y[k] += y
    if sum(n >= 4 for n in count) < 2:
        return (host_slope(seconds, tokens, median) if token_price is None else token_price), None
    b = _inside_slope(samples, count, sum_x, sum_y, kept) if token_price is None else token_price
    rest = [(y - b * x, k) for x, y, k in samples]
    mean_rest, mean_k = sum(r for r, _ in rest) / len(rest), sum(k for _, k in rest) / len(rest)
    c = max(sum((k - mean_k) * (r - mean_rest) for r, k in rest) / sum((k - mean_k) ** 2 for _, k in rest), 0.0)
    if mean_rest - c * mean_k < 0:
        return (None if token_price is None else b), None
    return b, c


def _inside_slope(samples: list[tuple[float, float, int]], count: list[int], sum_x: list[float], sum_y: list[float],
                  kept: float) -> float:
    """b from the samples within each k (tokens vary there with acceptance alone), `kept` where they hardly vary."""
    inside = [(x - sum_x[k] / count[k], y - sum_y[k] / count[k]) for x, y, k in samples]
    xx, mean_x = sum(x * x for x, _ in inside), sum(sum_x) / len(samples)
    varied = xx >= len(samples) * (0.05 * max(mean_x, 1e-9)) ** 2
    return max(sum(x * y for x, y in inside) / xx, 0.0) if varied else kept


def within_host(slope: float, per_draft: float, recursion: float, newest: list[tuple[float, float, int]],
                price_of: Callable[[float, float], list[float]], kept: float) -> tuple[float, float, float]:
    """(slope, per_draft, recursion) of a host line, bounded by its newest samples (per request: host seconds,
    tokens, k); price_of(per_draft, recursion) -> [K + 1] the drafts' price at each k."""
    # The slopes kept from before may not exceed the host's share now (the level would go negative); medians,
    # since a lap whose host share was clamped at 0 would otherwise zero them.
    slope = min(slope, plain_median([s / max(e, 1e-9) for s, e, _ in newest]))
    price = price_of(per_draft, recursion)
    over = plain_median([price[k] / max(s - slope * e, 1e-12) for s, e, k in newest if k > 0] or [0.0])
    if over > 1.0:
        per_draft, recursion = per_draft / over, recursion / over
        price = price_of(per_draft, recursion)
    # Nor may they price a step at k = 0 below `kept` of the host now: a step's host also schedules, plans and
    # reads back each request whatever it drafts (on the H100, k = 0 kept 0.58 of k = 4's host at c = 8 and 0.54 at
    # T = 1, c = 256). A window of one k cannot tell the level from the slopes, and one that put nearly all of a
    # greedy c = 128 step's host in its tokens and drafts priced k = 4 at 5.8x k = 0: auto ran k = 0, then caught
    # up all 128 requests (run 143).
    saved = plain_median([(slope * max(e - 1.0, 0.0) + price[k]) / max(s, 1e-12) for s, e, k in newest])
    if saved > 1.0 - kept:
        scale = (1.0 - kept) / saved
        slope, per_draft, recursion = slope * scale, per_draft * scale, recursion * scale
    return slope, per_draft, recursion
