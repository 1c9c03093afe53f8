"""Plain-torch rotate-half (NeoX) RoPE over the first `rot` dims of each head: the CPU path and the
Triton kernel's oracle."""

from __future__ import annotations

import torch


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [P, rot // 2] fp32, positions [T] -> x with its first rot dims rotated
    (in fp32, rounded to x's dtype); dims past rot pass through."""
    rot = 2 * cos.shape[-1]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)
