"""Which MTP module drafts which token, and where (docs/design.md §3).

Draft step j (0-based) produces the token at frontier + j. In the depth chain step j < L runs module j
at the drafting position p; steps past the last module recurse on module L-1 at p+1, p+2, ...
In the recursive chain (EAGLE style) every step runs module 0, at p, p+1, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

CHAIN_MODES = ("depth", "recursive")


@dataclass(frozen=True)
class ChainStep:
    module: int
    offset: int  # position offset from the drafting position p


def chain_steps(num_drafts: int, num_modules: int, mode: str) -> list[ChainStep]:
    if mode == "recursive":
        return [ChainStep(0, j) for j in range(num_drafts)]
    last = num_modules - 1
    return [ChainStep(j, 0) if j <= last else ChainStep(last, j - last) for j in range(num_drafts)]


@lru_cache(maxsize=None)
def extra_positions(num_drafts: int, num_modules: int, mode: str) -> tuple[int, ...]:
    """Per module: how many positions past p it writes (-1 when the chain does not use it). Cached: the
    scheduler asks per request per step."""
    extra = [-1] * num_modules
    for step in chain_steps(num_drafts, num_modules, mode):
        extra[step.module] = max(extra[step.module], step.offset)
    return tuple(extra)
