"""Start a weight's bytes on their way into the L2 while the step's small kernels leave HBM idle (Hopper).

Between the q/k/v projection and the o projection a decode layer runs q/k norm + RoPE + KV store, the
attention and its merge: at a few rows, a few microseconds in which HBM reads little (the batch's KV), while
the o projection then streams its 32 MiB weight (8B shape) at 52-65 % of its bytes' floor (H200, run 297: 12.4
us at 16 rows against 8.0). This kernel issues `cp.async.bulk.prefetch.L2` for the next GEMM's weight, one
chunk per lane, before its wait for the kernel ahead (PDL, kernels/pdl.py: weights are never written), so the
weight streams into the L2 while those kernels run and the GEMM finds it there. Nothing waits for the
prefetches; they are hints, and a line evicted before its use is read again from HBM as before.

  MTPSERVE_L2_PREFETCH=1 (default); last: with an evict-last hint; 0: off (A/B runs). Off on the CPU, under
  TRITON_INTERPRET=1 and before compute capability 9.0 (the bulk prefetch is Hopper's).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.pdl import wait_previous

CHUNK = 16384  # bytes per lane's bulk prefetch (a multiple of 16, as the instruction needs)
LANES = 128  # chunks per program: one per thread of its 4 warps
# The L2's share a prefetched weight may take: past it, the lines would evict each other (and the KV the
# attention reads) before the GEMM reads them.
MAX_L2_SHARE = 0.75

_PREFETCH = tl.constexpr("""{
    .reg .pred p;
    setp.gt.s32 p, $2, 0;
    @p cp.async.bulk.prefetch.L2.global [$1], $2;
    mov.u32 $0, 0;
}""")
# The same with an evict-last hint: the lines outlast the stream of KV the attention reads meanwhile.
_PREFETCH_LAST = tl.constexpr("""{
    .reg .pred p;
    .reg .b64 pol;
    setp.gt.s32 p, $2, 0;
    createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
    @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
    mov.u32 $0, 0;
}""")


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, EVICT_LAST: tl.constexpr,
                        PDL: tl.constexpr):
    """base: the tensor's address (int64); lane i of program p prefetches chunk p * LANES + i, up to nbytes
    (rounded down to 16 bytes: the instruction's granule)."""
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK  # [LANES] byte offsets
    size = (tl.minimum(nbytes - offs, CHUNK) // 16 * 16).to(tl.int32)  # <= 0 past the end: predicated off
    if EVICT_LAST:
        tl.inline_asm_elementwise(_PREFETCH_LAST, "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    wait_previous(PDL)  # the next kernel may depend on the one before this: keep PDL's order transitive


_INTERPRETED = not isinstance(_l2_prefetch_kernel, triton.runtime.jit.JITFunction)


def enabled(device: torch.device) -> bool:
    if os.environ.get("MTPSERVE_L2_PREFETCH", "1") == "0" or device.type != "cuda" or _INTERPRETED:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


@lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def l2_prefetch(weight: torch.Tensor) -> bool:
    """Start loading a contiguous tensor into the L2 where that is on and it fits MAX_L2_SHARE of it; CUDA-graph
    capturable (the address is baked into a captured launch, as every kernel's pointers are). -> whether issued."""
    if not enabled(weight.device) or not weight.is_contiguous():
        return False
    nbytes = weight.numel() * weight.element_size()
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    if nbytes == 0 or nbytes > MAX_L2_SHARE * _l2_bytes(index):
        return False
    grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK), LANES),)
    last = os.environ.get("MTPSERVE_L2_PREFETCH") == "last"
    _l2_prefetch_kernel[grid](weight.data_ptr(), nbytes, CHUNK=CHUNK, LANES=LANES, EVICT_LAST=last,
                              num_warps=LANES // 32, **pdl.options(weight.device))
    return True
