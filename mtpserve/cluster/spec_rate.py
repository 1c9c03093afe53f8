"""The step's k from the batch's expected tokens and its cost at each k (docs/design.md §9): the rate the adaptive
chooser (spec_chooser.py) maximises, apart so that a reader finds the accept-rate arithmetic in one place."""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import numpy as np


def expected_tokens(p: np.ndarray) -> np.ndarray:
    """p [R, K] conditional acceptance per position -> [R, K + 1]: E[tokens emitted | k drafts] for k = 0..K,
    i.e. 1 + sum_{j <= k} prod_{i <= j} p_i (the readable form of what AcceptanceTable keeps per row)."""
    return np.concatenate((np.ones((p.shape[0], 1)), 1.0 + np.cumsum(np.cumprod(p, axis=1), axis=1)), axis=1)


def rates(gains: Sequence[float], base: float, floor: int, cost: Sequence[float]) -> list[float]:
    """[K + 1] the batch's expected tokens per second at each k (choose_k's arguments)."""
    cost = cost.tolist() if isinstance(cost, np.ndarray) else cost
    tokens = accumulate(gains[: len(cost) - 1], initial=base)
    return [t / cost[max(k, floor)] for k, t in enumerate(tokens)]


def choose_k(gains: Sequence[float], base: float, floor: int, cost: Sequence[float], current: int,
             hysteresis: float = 0.0, modules: int | None = None, free_hysteresis: float = 0.0) -> int:
    """The step's k in 0..K maximising expected tokens per second of the batch.

    gains [K]: summed over the adaptive requests, the expected extra tokens of draft position j + 1 (zero
    past a request's cap); base: tokens the step emits whatever k is (one per request plus the fixed
    requests' accepted drafts); floor: the largest fixed request's k (the step runs at least that);
    cost [K + 1]: seconds (or any proportional unit) of a step at each k. `current` stays unless another
    k beats it by the fraction `hysteresis`, or by `free_hysteresis` where both k's reach every one of `modules`
    MTP modules (past them the chain reruns the last one): such a switch leaves no module behind and catches none
    up. Plain Python over K + 1 floats (numpy calls on this cold path cost several microseconds each inside the
    engine).
    """
    rate = rates(gains, base, floor, cost)
    best = max(range(len(rate)), key=rate.__getitem__)  # the first of equal rates, as argmax
    if 0 <= current < len(rate):
        free = modules is not None and min(best, current) >= modules
        if rate[best] <= rate[current] * (1.0 + (free_hysteresis if free else hysteresis)):
            return current
    return best
