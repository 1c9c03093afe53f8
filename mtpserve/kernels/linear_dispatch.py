"""Which GEMM runs a linear layer's product: F.linear (cuBLAS) or skinny_gemm, chosen per measured shape.

cuBLAS stays the default everywhere: the Triton kernel takes a call only where it was measured to win.

  MTPSERVE_SKINNY_GEMM=off   (default) every product is F.linear
  MTPSERVE_SKINNY_GEMM=auto  skinny_gemm where the table says it beat F.linear for this device, dtype,
                             M bucket, N and K; a shape missing from the table is measured the first
                             time it runs outside a CUDA-graph capture, and cuBLAS takes it meanwhile
  MTPSERVE_SKINNY_GEMM=on    skinny_gemm for every eligible call, with its best measured config (A/B runs);
                             a shape first seen inside a capture still goes to cuBLAS (nothing compiled)
  MTPSERVE_SKINNY_TABLE=path a JSON table written by benchmarks/gemm_benchmark.py (--table-out), loaded
                             at import; entries of another device are ignored

Eligible: a CUDA tensor, bf16 or fp16, 1..MAX_ROWS rows. Capture safety: a measurement syncs the
device, so it never runs while a stream captures; the runners warm every graph's step up eagerly
before capturing it (cuda_graphs.WARMUP_RUNS), which measures each shape a graph will hold, at start
when graphs are captured at start. A measurement times F.linear and skinny_gemm's candidate configs
the way a captured step runs them: back to back in a CUDA graph, on weights that are not L2-resident.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.kernels import cpu_linear

MODES = ("off", "on", "auto")
ELIGIBLE_DTYPES = (torch.bfloat16, torch.float16)
WIN_MARGIN = 0.98  # skinny_gemm must be 2 % faster: a tie within timing noise stays with cuBLAS


@dataclass(frozen=True)
class Choice:
    """The measurement of one shape: skinny_gemm's best config and both times (microseconds)."""

    config: tuple[int, ...]  # SkinnyConfig fields (block_n, block_k, split, num_warps, num_stages)
    skinny_us: float
    cublas_us: float

    @property
    def skinny_wins(self) -> bool:
        return self.skinny_us < WIN_MARGIN * self.cublas_us


_mode = "off"
_table: dict[str, Choice] = {}


def set_mode(mode: str) -> None:
    """Switch the dispatch (benchmarks A/B in one process; graphs captured before keep their choice)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"skinny GEMM mode {mode!r}: expected one of {MODES}")
    _mode = mode


def mode() -> str:
    return _mode


def shape_key(device_name: str, dtype: torch.dtype, bucket: int, n: int, k: int) -> str:
    return f"{device_name}|{str(dtype).removeprefix('torch.')}|m{bucket}|n{n}|k{k}"


@lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def record(key: str, choice: Choice) -> None:
    _table[key] = choice


def table() -> dict[str, Choice]:
    return dict(_table)


def save_table(path: Path, entries: dict[str, Choice]) -> None:
    rows = {key: {"config": list(c.config), "skinny_us": c.skinny_us, "cublas_us": c.cublas_us}
            for key, c in sorted(entries.items())}
    Path(path).write_text(json.dumps({"version": 1, "entries": rows}, indent=1) + "\n")


def load_table(path: Path) -> int:
    """Add a gemm_benchmark table to the dispatch's; -> entries read."""
    rows = json.loads(Path(path).read_text())["entries"]
    for key, row in rows.items():
        _table[key] = Choice(tuple(row["config"]), float(row["skinny_us"]), float(row["cublas_us"]))
    return len(rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through skinny_gemm where the mode and the measurements say so (on the CPU,
    through a weight packed once for oneDNN: mtpserve/kernels/cpu_linear.py)."""
    if cpu_linear.eligible(x, weight):
        return cpu_linear.linear(x, weight, bias)
    if _mode == "off" or not x.is_cuda or x.dtype not in ELIGIBLE_DTYPES or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    from mtpserve.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_gemm

    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= MAX_ROWS or weight.stride(-1) != 1:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        return F.linear(x, weight, bias)
    config = _config_for(x2, weight, bias)
    if config is None:
        return F.linear(x, weight, bias)
    return skinny_gemm(x2, weight, bias, SkinnyConfig(*config)).view(*x.shape[:-1], weight.shape[0])


def _config_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...] | None:
    """The skinny config to run, or None for cuBLAS; measures a new shape when the stream is not capturing."""
    from mtpserve.kernels.skinny_gemm import m_bucket

    (rows, k), n = x.shape, weight.shape[0]
    key = shape_key(_device_name(x.device), x.dtype, m_bucket(rows), n, k)
    choice = _table.get(key)
    if choice is None and not torch.cuda.is_current_stream_capturing():
        choice = _table[key] = measure(x, weight, bias)
    if choice is None or not choice.config:  # first seen inside a capture (nothing compiled), or no config fits
        return None
    return choice.config if _mode == "on" or choice.skinny_wins else None


def measure(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, reps: int = 5) -> Choice:
    """Time F.linear and every candidate config as a captured step runs them; syncs the device.

    Each is captured CALLS times back to back into one CUDA graph, each call on the next of a few copies
    of the weight (twice the L2 in all, so no call finds its weight cached; at most CALLS), timed per call
    over replays. Timed one call at a time after an L2 eviction instead, cuBLAS had looked as fast as the
    skinny kernel on most 8B shapes, and auto kept it, while in the captured step the skinny kernel on
    every product took the batch-1 step from 6.02 to 5.80 ms (H100, runs 85-86): a call alone also
    pays its launch and ramp, which a graph overlaps with the call before. A serving process has given
    most of its memory to KV pools: a shape whose copies do not fit is left to cuBLAS."""
    from mtpserve.kernels.skinny_gemm import candidate_configs, num_sms, skinny_gemm

    (rows, k), n = x.shape, weight.shape[0]
    l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
    copies = min(CALLS, max(1, -(-2 * l2 // (weight.numel() * weight.element_size()))))  # a graph uses CALLS
    try:
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        cublas = _replay_us(lambda w: F.linear(x, w, bias), weights, reps)
    except torch.cuda.OutOfMemoryError:
        warnings.warn(f"no memory to measure {tuple(weight.shape)} at M={rows}: cuBLAS takes it")
        return Choice((), float("inf"), 0.0)
    best: tuple[float, tuple[int, ...]] | None = None
    for cfg in candidate_configs(rows, n, k, num_sms(x.device)):
        try:
            us = _replay_us(lambda w: skinny_gemm(x, w, bias, cfg), weights, reps)
        except Exception as exc:  # e.g. OutOfResources (shared memory) on a smaller GPU: skip that config
            warnings.warn(f"skinny_gemm config {cfg} failed for {tuple(weight.shape)} at M={rows}: {exc!r}")
            continue
        if best is None or us < best[0]:
            best = (us, tuple(cfg.as_list()))
    return Choice((), float("inf"), cublas) if best is None else Choice(best[1], best[0], cublas)


CALLS = 12  # products per measuring graph: enough for the gaps between them to show, short to capture


def _replay_us(product: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], reps: int) -> float:
    """Median microseconds per product over `reps` replays of a graph of CALLS products, cycling the weights."""
    for w in weights:
        product(w)  # compiles, picks cuBLAS's kernel: nothing is compiled inside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    # Not torch.cuda.graph: its entry collects garbage and empties the cache, tens of ms for each of the dozens
    # of graphs a warm-up measures. thread_local: a server thread's CUDA calls must not abort the capture, nor
    # may the garbage collector free another graph meanwhile (cuda_graphs.capture_graph).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for i in range(CALLS):
                    product(weights[i % len(weights)])
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    graph.replay()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1e3 * sorted(start.elapsed_time(end) for start, end in events)[reps // 2] / CALLS


class DispatchedLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose product goes through `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


set_mode(os.environ.get("MTPSERVE_SKINNY_GEMM", "off"))
if os.environ.get("MTPSERVE_SKINNY_TABLE"):
    load_table(Path(os.environ["MTPSERVE_SKINNY_TABLE"]))
