"""benchmarks/token_counts.py: a k's tokens a step, drawn from steps at k or above, as the product of
per-position rates and by counting the steps k would take over the same accepted runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import token_counts  # noqa: E402


def _steps(flags: np.ndarray, k: int) -> list[tuple[int, int]]:
    """Steps of k drafts over a stream of per-token flags (1: a draft of that token is accepted): each step drafts
    the next k tokens, accepts up to the first 0, and emits one token more (the correction or the bonus)."""
    out, at = [], 0
    while at + k + 1 <= len(flags):
        window = flags[at:at + k]
        accepted = int(np.argmin(window)) if (window == 0).any() else k
        out.append((k, accepted))
        at += accepted + 1
    return out


def test_at_the_ks_own_steps_both_give_their_acceptance_length() -> None:
    outcomes = [(3, 0), (3, 3), (3, 1), (3, 2), (3, 3)]
    length = sum(a + 1 for _, a in outcomes) / len(outcomes)
    assert token_counts.product_tokens(outcomes, 3) == pytest.approx(length)
    assert token_counts.counted_tokens(outcomes, 3) == pytest.approx(length)
    assert math.isnan(token_counts.counted_tokens(outcomes, 4))  # nothing drafted that far


def test_with_acceptance_alike_everywhere_both_agree_with_a_smaller_ks_steps() -> None:
    flags = (np.random.default_rng(0).random(400_000) < 0.6).astype(int)
    at_4, at_2 = _steps(flags, 4), _steps(flags, 2)
    measured = sum(a + 1 for _, a in at_2) / len(at_2)
    assert measured == pytest.approx(1 + 0.6 + 0.36, rel=0.01)
    assert token_counts.product_tokens(at_4, 2) == pytest.approx(measured, rel=0.01)
    assert token_counts.counted_tokens(at_4, 2) == pytest.approx(measured, rel=0.01)


def test_with_easy_and_hard_stretches_counting_follows_a_smaller_ks_steps_and_the_product_does_not() -> None:
    """Stretches of 40 tokens, easy (0.95 a token) and hard (0.2) by turns: steps at k = 4 cover an easy stretch
    in fewer steps than k = 1's, so per step the hard ones weigh more and the product prices k = 1 short."""
    rng = np.random.default_rng(1)
    p = np.where((np.arange(400_000) // 40) % 2 == 0, 0.95, 0.2)
    flags = (rng.random(p.size) < p).astype(int)
    at_4, at_1 = _steps(flags, 4), _steps(flags, 1)
    measured = sum(a + 1 for _, a in at_1) / len(at_1)
    assert token_counts.counted_tokens(at_4, 1) == pytest.approx(measured, rel=0.02)
    assert token_counts.product_tokens(at_4, 1) < 0.95 * measured
