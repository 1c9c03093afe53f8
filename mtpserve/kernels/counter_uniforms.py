"""Triton counter-based uniforms: counter_uniforms_ref's hash in one kernel.

In torch the hash is about thirty elementwise ops, each a kernel of its own: in a captured uniform step at
batch 1 each launch costs a microsecond or two, and a sampled step draws uniforms once per draft and
twice for its verification. The kernel computes the same int64 arithmetic (products wrap, shifts made
logical by masking), so its bits equal the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels.counter_uniforms_ref import GOLDEN, M1, M2


@triton.jit
def _mix(x, m1, m2):
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * m1  # the masks keep the 64 - s low bits: a logical shift
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * m2
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


@triton.jit
def counter_uniform(seed, index, stream, golden, m1, m2):
    """The uniform of int64 (seed, index) in `stream`, for kernels that draw their own (GOLDEN, M1 and M2 passed
    in as int64 arguments)."""
    x = _mix(seed * golden + stream, m1, m2)
    x = _mix(x ^ (index * m2), m1, m2)
    return ((x >> 40) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _counter_uniforms_kernel(out_ptr, seed_ptr, index_ptr, n, stream, golden, m1, m2, BLOCK: tl.constexpr):
    # seed, index, out: [n] (the broadcast shape, flattened)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    seed = tl.load(seed_ptr + offs, mask=ok, other=0)
    index = tl.load(index_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + offs, counter_uniform(seed, index, stream, golden, m1, m2), mask=ok)


def counter_uniforms(seed: torch.Tensor, index: torch.Tensor, stream: int, block: int = 256) -> torch.Tensor:
    """Drop-in for counter_uniforms_ref: int64 seed and index (broadcastable) -> float32 uniforms in [0, 1)."""
    if seed.dtype != torch.int64 or index.dtype != torch.int64:
        raise ValueError(f"seed and index must be int64, got {seed.dtype} and {index.dtype}")
    seed, index = (t.contiguous() for t in torch.broadcast_tensors(seed, index))
    out = torch.empty(seed.shape, dtype=torch.float32, device=seed.device)
    n = out.numel()
    if n:
        block = min(block, triton.next_power_of_2(n))
        # The multipliers travel as int64 arguments (a literal's type would follow its value).
        _counter_uniforms_kernel[(triton.cdiv(n, block),)](out, seed, index, n, stream, GOLDEN, M1, M2, BLOCK=block,
                                                          num_warps=1)
    return out
