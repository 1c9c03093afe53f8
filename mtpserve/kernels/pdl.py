"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it drains.

A decode step of an 8B model at batch 1 is ~350 short kernels in one CUDA graph; between two of them the
SMs idle while the first one's last programs finish and the second one's programs are scheduled and
issue their first loads. Launched with PDL, the second kernel's programs are placed on the SMs the first
one frees and wait there (`griddepcontrol.wait`) until it has completed and its writes are visible.

The contract every kernel launched with `options()` keeps: before `wait_previous`, it reads only what no
kernel of the step writes (weights) and writes nothing. (Only the kernel just before could still be
writing, but which kernel that is depends on the model and the dispatch: weights are what is safe.)
`wait_previous` waits for the whole previous grid, and that grid itself waited for its own predecessor
before it could finish, so a PDL kernel also sees everything written before it in stream order. It then
lets its own successor launch.

`MTPSERVE_PDL=0` at start (or `set_enabled(False)`, for A/B timing in one process) turns it off; it is off
on the CPU, under TRITON_INTERPRET=1, before compute capability 9.0, on ROCm, and with a Triton whose
launcher lacks the option. Eager steps ask for every launch, so asking costs a global read and a cache hit.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: _supported is False, the calls never compile
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream to complete, then let the next one launch (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_INTERPRETED = not isinstance(wait_previous, triton.runtime.jit.JITFunction)
_wanted = os.environ.get("MTPSERVE_PDL", "1") != "0"


def set_enabled(on: bool) -> None:
    """Launch with PDL where supported (True, the default) or never; graphs captured before keep theirs."""
    global _wanted
    _wanted = on


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (the PDL constexpr their wrappers pass)."""
    if not _wanted or device.type != "cuda" or _INTERPRETED:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def options(device: torch.device) -> dict[str, bool]:
    """A launch's PDL constexpr and option, decided once: **options(device) in the kernel's call (a kernel
    compiled without the wait must never launch with PDL, whatever set_enabled does meanwhile)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    if gdc_wait is None or torch.version.hip is not None or torch.cuda.get_device_capability(index) < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
