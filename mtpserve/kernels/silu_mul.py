"""Triton SwiGLU activation: silu(gate) * up from the fused gate/up projection, one kernel instead of two.

Semantics of `silu_mul_ref` (silu_mul_ref.py): silu in fp32, rounded to the input dtype, then the product rounded again,
as `F.silu(gate) * up` computes it. gate_up is [T, 2I] (gate columns first), possibly a strided view;
the output is a fresh contiguous [T, I]. Programs tile the columns so wide MLPs keep many in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels import pdl
from mtpserve.kernels.pdl import wait_previous


@triton.jit
def _silu_mul_kernel(out_ptr, x_ptr, stride_xt, stride_ot, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(x_ptr + token * stride_xt + offs, mask=ok, other=0.0)
    up = tl.load(x_ptr + token * stride_xt + inter + offs, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu's rounding
    tl.store(out_ptr + token * stride_ot + offs, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Drop-in for silu_mul_ref on [T, 2I] rows with a unit column stride."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with a unit column stride, got {tuple(gate_up.shape)}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(block, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out, gate_up, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
            **pdl.options(gate_up.device))
    return out
