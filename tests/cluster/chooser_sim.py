"""Synthetic tables and simulated steps for the adaptive-speculation chooser's tests (test_spec_chooser.py,
test_spec_dwell.py, test_spec_probes.py)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.spec_config import AdaptiveConfig

K = 4
COSTS = [1.0, 1.1, 1.2, 1.3, 1.4]


def spec_with(p: np.ndarray, costs: list[float], caps: list[int] | None = None, fixed: list[bool] | None = None,
          hysteresis: float = 0.0) -> tuple[AdaptiveSpec, np.ndarray]:
    """An AdaptiveSpec whose requests have acceptance p [R, K] and whose batch costs `costs` [K + 1]."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=64, hysteresis=hysteresis, min_dwell=0))
    caps = caps or [K] * len(p)
    fixed = fixed or [False] * len(p)
    rows = np.array([spec.admit(c, not f) for c, f in zip(caps, fixed)])
    spec.acceptance.set(rows, p.T)
    for k, seconds in enumerate(costs):
        spec.costs.observe(len(p), k, seconds)
    return spec, rows


def serve_step(spec: AdaptiveSpec, rows: np.ndarray, p: float, cost: Callable[[int], float],
                rng: np.random.Generator) -> int:
    """One simulated decode step: choose k, accept each draft with probability p, time the step; -> k."""
    k = spec.choose(rows)
    accepted = np.argmin(np.concatenate((rng.uniform(size=(len(rows), k)) < p, np.zeros((len(rows), 1), bool)), 1), 1)
    spec.acceptance.observe(rows, np.full(len(rows), k), accepted)
    spec.costs.observe(len(rows), k, cost(k))
    return k
