"""The MLP's down projection with its SwiGLU activation folded in: silu(gate) * up @ W^T as one kernel, where
that was measured faster than the activation's own kernel followed by the product's own route.

skinny_gemm(gated=True) makes each x tile from the gate/up projection's output as it loads it, with the
activation kernel's roundings (kernels/skinny_gemm.py): the same bits as silu_mul then skinny_gemm with that
config, one kernel a layer fewer (and the [M, I] activation's round trip through memory). Every weight strip
recomputes the activation of its tiles, an exp per element per strip, so it can pay at few rows only. So it is
measured like the plain products (linear_dispatch.measure: in a CUDA graph, after a Triton kernel, on weights
that are not in L2): per (device, dtype, M bucket, N, K) up to GATED_MAX_ROWS rows, the best gated config
against silu_mul followed by the route the plain product of that shape takes. The table keeps such a shape
under its plain key + SUFFIX, the gated time as `skinny_us` and the two kernels' as `cublas_us`.

  MTPSERVE_SKINNY_GATED=on   (default) where measured faster
  MTPSERVE_SKINNY_GATED=off  the activation's own kernel always (A/B runs)
"""

from __future__ import annotations

import os
import warnings

import torch

from mtpserve.kernels import linear_dispatch as dispatch

GATED_MAX_ROWS = 64  # past this the strips' repeated activations cost more than the kernel they save
SUFFIX = "|swiglu"


def enabled() -> bool:
    return os.environ.get("MTPSERVE_SKINNY_GATED", "on") != "off"


def linear_gated(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu_mul(gate_up), weight, bias) for gate_up [..., 2I] (gate columns first) on a GPU: one kernel
    where the dispatch measured that faster, else silu_mul and the dispatch's product."""
    from mtpserve.kernels.silu_mul import silu_mul
    from mtpserve.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

    rows = gate_up.numel() // max(gate_up.shape[-1], 1)
    flat = gate_up.reshape(rows, gate_up.shape[-1])
    config = _config_for(flat, weight, bias) if _eligible(flat, weight) else None
    if config is None:
        out = dispatch.linear(silu_mul(flat), weight, bias)
    else:
        out = skinny_gemm(flat, weight, bias, SkinnyConfig(*config), gated=True)
    return out.view(*gate_up.shape[:-1], weight.shape[0])


def _eligible(flat: torch.Tensor, weight: torch.Tensor) -> bool:
    return (enabled() and dispatch.mode() != "off" and flat.is_cuda and flat.dtype in dispatch.ELIGIBLE_DTYPES
            and weight.dtype == flat.dtype and 0 < flat.shape[0] <= GATED_MAX_ROWS
            and flat.shape[1] == 2 * weight.shape[1] and flat.stride(1) == 1 and weight.stride(1) == 1)


def _config_for(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...] | None:
    """The gated config to run, or None for the two kernels (measured first where new and not capturing)."""
    from mtpserve.kernels.skinny_gemm import m_bucket

    (n, k), rows = weight.shape, flat.shape[0]
    key = dispatch.shape_key(dispatch.device_name(flat.device), flat.dtype, m_bucket(rows), n, k) + SUFFIX
    choice = dispatch.measured(key, lambda: measure(flat, weight, bias))
    if choice is None or not choice.config:
        return None
    return choice.config if dispatch.route_taken(choice) == "skinny" else None


def measure(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, reps: int = 5
            ) -> dispatch.Choice:
    """The best gated config's microseconds (skinny_us) against silu_mul and the plain product's route (cublas_us),
    each after a Triton kernel that writes gate_up, in a graph over weights not in L2; syncs the device."""
    from mtpserve.kernels.rmsnorm import rms_norm
    from mtpserve.kernels.silu_mul import silu_mul
    from mtpserve.kernels.skinny_gemm import skinny_gemm

    (rows, width), (n, k) = flat.shape, weight.shape
    ones = torch.ones(width, dtype=flat.dtype, device=flat.device)
    try:
        weights = dispatch.weight_copies(weight)
        apart = dispatch.replay_us(lambda w: dispatch.linear(silu_mul(rms_norm(flat, ones, 1e-6)), w, bias),
                                   weights, reps)
    except torch.cuda.OutOfMemoryError:
        warnings.warn(f"no memory to measure the gated {tuple(weight.shape)} at M={rows}: the activation's kernel")
        return dispatch.Choice((), float("inf"), 0.0)
    best = dispatch.best_config(
        rows, n, k, flat.device, weights, reps,
        lambda cfg: lambda w: skinny_gemm(rms_norm(flat, ones, 1e-6), w, bias, cfg, gated=True), tag="gated")
    return dispatch.Choice((), float("inf"), apart) if best is None else dispatch.Choice(best[1], best[0], apart)
