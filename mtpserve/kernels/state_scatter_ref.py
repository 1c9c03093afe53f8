"""The torch reference of state_scatter: a step's packed diffs written into the device-resident state."""

from __future__ import annotations

import torch


def state_scatter_ref(
    packed: torch.Tensor,  # [2 * (n0 + n1 + n2 + n3)] int64: per section its flat indices, then its values
    counts: tuple[int, int, int, int],  # section sizes: block tables, capacities, int fields, float fields
    tables: torch.Tensor,  # [G, S, MB] int32
    capacity: torch.Tensor,  # [G, S] int64
    ints: torch.Tensor,  # [5, S] int64
    floats: torch.Tensor,  # [7, S] float32; its values travel as float64 bits
) -> None:
    """Each section's values written at its flat indices of its tensor (indices unique within a section)."""
    at = 0
    for n, flat, float_bits in ((counts[0], tables, False), (counts[1], capacity, False),
                                (counts[2], ints, False), (counts[3], floats, True)):
        if n:  # most steps change nothing: no kernels at all
            idx, val = packed[at : at + n], packed[at + n : at + 2 * n]
            flat.view(-1)[idx] = val.view(torch.float64).float() if float_bits else val.to(flat.dtype)
        at += 2 * n
