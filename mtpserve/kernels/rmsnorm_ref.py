"""Plain-torch RMSNorm with an optional residual add first: the CPU path and the Triton kernel's oracle."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (plus residual, same shape) -> normed [..., D], or (normed, x + residual)."""
    summed = x if residual is None else x + residual
    xf = summed.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, summed)
