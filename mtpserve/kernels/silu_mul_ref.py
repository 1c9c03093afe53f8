"""Plain-torch SwiGLU activation: the CPU path and the Triton kernel's oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
