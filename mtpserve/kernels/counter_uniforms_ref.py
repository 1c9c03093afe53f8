"""Counter-based uniforms in plain torch: the CPU path and the oracle of counter_uniforms.py.

A uniform is a hash (splitmix64's finaliser, twice) of (seed, token index, stream), so a seeded request
draws the same numbers whatever else is in the batch and drawing advances no shared state
(docs/design.md §4). Every step is exact int64 arithmetic (products wrap), so any implementation gives
the same bits.
"""

from __future__ import annotations

import torch

M1, M2 = -4658895280553007687, -7723592293110705685  # splitmix64 multipliers as signed int64
GOLDEN = -7046029254386353131


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * M1
    x = (x ^ _shr(x, 27)) * M2
    return x ^ _shr(x, 31)


def counter_uniforms_ref(seed: torch.Tensor, index: torch.Tensor, stream: int) -> torch.Tensor:
    """seed, index: int64 tensors (broadcastable) -> float32 uniforms in [0, 1) of their broadcast shape."""
    x = _mix(seed * GOLDEN + stream)
    x = _mix(x ^ (index * M2))
    return _shr(x, 40).float() * (1.0 / (1 << 24))
