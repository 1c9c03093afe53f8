"""A step's state diffs scattered into the device-resident state in one launch (state_scatter_ref's twin).

Most decode steps at k >= 1 append a block to some request's tables (one per KV group in use), so the
step's copy carries two or more diff sections. Written section by section with torch indexing, that was
8-12 host-side torch calls, 0.07 ms of a 0.58 ms step at concurrency 8 on the H100's host (session M,
run 120), where the step is host-bound. Here one program block per (section, chunk of its entries)
reads the packed pairs and stores into the section's tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # entries per program


# The section sizes change from step to step: specialised (Triton keys ints on == 1 and % 16), each new
# pattern of them compiled a variant in the middle of serving.
@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3"])
def _state_scatter_kernel(packed_ptr, tables_ptr, capacity_ptr, ints_ptr, floats_ptr, n0, n1, n2, n3,
                          BLOCK: tl.constexpr):
    section, chunk = tl.program_id(0), tl.program_id(1)
    # Section s starts at 2 * (n0 + ... + n_{s-1}) in packed: its n_s indices, then its n_s values.
    n = tl.where(section == 0, n0, tl.where(section == 1, n1, tl.where(section == 2, n2, n3)))
    start = 2 * tl.where(section == 0, 0, tl.where(section == 1, n0, tl.where(section == 2, n0 + n1, n0 + n1 + n2)))
    j = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] entries of the section
    ok = j < n
    idx = tl.load(packed_ptr + start + j, mask=ok, other=0)
    val = tl.load(packed_ptr + start + n + j, mask=ok, other=0)
    if section == 0:
        tl.store(tables_ptr + idx, val.to(tl.int32), mask=ok)
    elif section == 1:
        tl.store(capacity_ptr + idx, val, mask=ok)
    elif section == 2:
        tl.store(ints_ptr + idx, val, mask=ok)
    else:
        tl.store(floats_ptr + idx, val.to(tl.float64, bitcast=True).to(tl.float32), mask=ok)


def state_scatter(
    packed: torch.Tensor,  # [2 * (n0 + n1 + n2 + n3)] int64: per section its flat indices, then its values
    counts: tuple[int, int, int, int],  # section sizes: block tables, capacities, int fields, float fields
    tables: torch.Tensor,  # [G, S, MB] int32, contiguous
    capacity: torch.Tensor,  # [G, S] int64, contiguous
    ints: torch.Tensor,  # [5, S] int64, contiguous
    floats: torch.Tensor,  # [7, S] float32, contiguous; its values travel as float64 bits
) -> None:
    """Each section's values written at its flat indices of its tensor (indices unique within a section)."""
    longest = max(counts)
    if longest == 0:
        return
    for t, dtype in ((tables, torch.int32), (capacity, torch.int64), (ints, torch.int64), (floats, torch.float32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"state tensor {tuple(t.shape)} {t.dtype}: expected contiguous {dtype}")
    _state_scatter_kernel[(4, triton.cdiv(longest, BLOCK))](packed, tables, capacity, ints, floats, *counts,
                                                            BLOCK=BLOCK, num_warps=4)
