"""Kernel test backends: Triton kernels interpreted on CPU (TRITON_INTERPRET=1), or compiled on CUDA.

The choice is per process: Triton decorates its own standard library (tl.max, tl.sum, ...) as either
interpreted or compiled functions when it is first imported, and a kernel of the other kind cannot
call them. So this file, imported before any test module, sets TRITON_INTERPRET=1 when the variable is
unset and there is no GPU, i.e. before triton is imported. With a GPU the process stays compiled (so
the rest of the suite gets real kernels too), the "cuda" parametrizations run here, and one test
re-runs the "interpret-cpu" ones in a child process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

_TRITON_PREIMPORTED = "triton" in sys.modules
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() and not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton  # noqa: F401

    _TRITON_ERROR = None
except Exception as exc:  # ImportError, or a broken install failing at import time
    _TRITON_ERROR = f"triton is not importable: {exc!r}"


@dataclass(frozen=True)
class KernelBackend:
    device: torch.device
    paged_attention: Callable[..., torch.Tensor]
    paged_attention_split: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]


BACKENDS = [
    pytest.param("interpret-cpu", id="interpret-cpu"),
    pytest.param(
        "cuda", id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


def _skip_reason(backend: str) -> str | None:
    if _TRITON_ERROR is not None:
        return _TRITON_ERROR
    if backend == "interpret-cpu" and not INTERPRET:
        if _TRITON_PREIMPORTED and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
            return "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1"
        return "this process compiles the kernels (a child process runs them with TRITON_INTERPRET=1)"
    if backend == "cuda" and INTERPRET:
        return "TRITON_INTERPRET=1 in this process: kernels are interpreted, not compiled"
    return None


@pytest.fixture(params=BACKENDS)
def kernels(request) -> KernelBackend:
    reason = _skip_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    from mtpserve.kernels.paged_attention import paged_attention
    from mtpserve.kernels.paged_attention_split import paged_attention_split
    from mtpserve.kernels.store_kv import store_kv

    device = torch.device("cpu" if request.param == "interpret-cpu" else "cuda")
    return KernelBackend(device=device, paged_attention=paged_attention, paged_attention_split=paged_attention_split,
                         store_kv=store_kv)
