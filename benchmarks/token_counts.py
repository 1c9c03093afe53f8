"""Tokens a step at k would emit, drawn from steps that ran at k or above (docs/adaptive-measurements.md, session AB).

Adaptive speculation prices a k's tokens as the product of per-position acceptance estimates:
1 + sum_{j < k} prod_{i <= j} p_i. A request's acceptance varies along it, and a step at a larger k covers more
of an easy stretch, so per step the hard stretches weigh more: drawn from steps at k = 4, the product priced
k = 1 and 2 at 3-5 % fewer tokens than those k's own steps made (H100, T = 1 and greedy random prompts).

Counting reads each step's accepted run as a run of tokens the drafts could predict, and counts the steps a
chain of k drafts would take over the same tokens: a run of a accepted drafts ended by a rejection (a < d) is
a + 1 tokens that k covers in ceil((a + 1) / (k + 1)) steps; a run where all d drafts were accepted continues
into the next step, (d + 1) / (k + 1) steps. From the H100's k = 4 cells it gives k = 1 / 2 / 3 within 0-3 % of
their own steps' tokens (benchmarks/RESULTS.md, session AB).

cell_phases.py --trace-tokens prints both per cell, to set beside the fixed-k cells' acceptance length.
"""

from __future__ import annotations

import math
from typing import Sequence

Outcome = tuple[int, int]  # one request's step: (drafts, accepted)


def product_tokens(outcomes: Sequence[Outcome], k: int) -> float:
    """1 + sum_{j < k} prod_{i <= j} (hits_i / seen_i) over the outcomes that drafted k or more (nan: none)."""
    usable = [(d, a) for d, a in outcomes if d >= k]
    if not usable:
        return math.nan
    tokens, reach = 1.0, 1.0
    for i in range(k):
        seen = sum(1 for _, a in usable if a >= i)  # position i was verified: every draft before it accepted
        hits = sum(1 for _, a in usable if a > i)
        reach *= hits / seen if seen else 0.0
        tokens += reach
    return tokens


def counted_tokens(outcomes: Sequence[Outcome], k: int) -> float:
    """Tokens a step at k emits over the same tokens as the outcomes that drafted k or more (nan: none)."""
    usable = [(d, a) for d, a in outcomes if d >= k]
    if not usable:
        return math.nan
    tokens = sum(a + 1 for _, a in usable)
    steps = sum(math.ceil((a + 1) / (k + 1)) if a < d else (d + 1) / (k + 1) for d, a in usable)
    return tokens / steps
