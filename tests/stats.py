"""Goodness-of-fit helpers for the losslessness tests, with the sample size their power needs."""

from __future__ import annotations

import numpy as np
from scipy import stats

ALPHA = 0.001


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """One-sample chi-square of observed counts against exact probabilities.

    Cells expected to hold fewer than 5 samples are pooled into one, as the test's approximation needs.
    A sample landing where the probability is exactly zero is a certain mismatch: p-value 0.
    """
    counts, probs = np.asarray(counts, dtype=float).ravel(), np.asarray(probs, dtype=float).ravel()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def samples_for_power(num_cells: int, tv: float, power: float = 0.9, alpha: float = ALPHA) -> int:
    """Samples a chi-square test over num_cells needs to detect a total-variation distance `tv`.

    Any two distributions at TV distance tv are at chi-square divergence >= 4 tv^2, so the test
    statistic's noncentrality is at least n * 4 tv^2; find the smallest n reaching the power.
    """
    df = num_cells - 1
    critical = stats.chi2.ppf(1 - alpha, df)
    n = 100
    while stats.ncx2.sf(critical, df, n * 4 * tv * tv) < power:
        n = int(n * 1.1) + 1
    return n
