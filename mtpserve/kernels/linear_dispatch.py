"""Which GEMM runs a linear layer's product: F.linear (cuBLAS, or cuBLASLt) or skinny_gemm, chosen per measured
shape.

  MTPSERVE_SKINNY_GEMM=auto  (default) skinny_gemm or F.linear with cuBLASLt preferred, whichever was measured
                             fastest, where it beat plain F.linear (cuBLAS) for this device,
                             dtype, M bucket, N and K;
                             a shape missing from the table is measured the first time it runs outside a
                             CUDA-graph capture, and cuBLAS takes it meanwhile
  MTPSERVE_SKINNY_GEMM=off   every product is F.linear
  MTPSERVE_SKINNY_GEMM=on    skinny_gemm for every eligible call, with its best measured config (A/B runs);
                             a shape first seen inside a capture still goes to cuBLAS (nothing compiled)
  MTPSERVE_CUBLASLT=on       (default) also measure F.linear with cuBLASLt preferred, and take it where it is
                             fastest; off: cuBLAS and skinny_gemm only (for A/B runs also set
                             MTPSERVE_SKINNY_CACHE empty, since a cache keeps what was measured before)
  MTPSERVE_SKINNY_FUSED=on   (default) skinny_gemm's split configs also come with the split sum fused into the
                             GEMM's last program per tile; off: the second kernel sums them (A/B runs, with
                             MTPSERVE_SKINNY_CACHE empty)
  MTPSERVE_SKINNY_TABLE=path a JSON table written by benchmarks/gemm_benchmark.py (--table-out), loaded
                             at import; entries of another device are ignored
  MTPSERVE_SKINNY_CACHE=path where measured choices persist between starts (default
                             ~/.cache/mtpserve/skinny_gemm.json; empty: nowhere). A machine measures a
                             shape once: later starts skip the measurement and pick the same kernels, so
                             a model's outputs do not change between restarts with the timing noise.

Eligible: a CUDA tensor, bf16 or fp16, 1..MAX_ROWS rows. Capture safety: a measurement syncs the
device, so it never runs while a stream captures; the runners warm every graph's step up eagerly
before capturing it (cuda_graphs.WARMUP_RUNS), which measures each shape a graph will hold, at start
when graphs are captured at start. A measurement times F.linear and skinny_gemm's candidate configs
the way a captured step runs them: back to back in a CUDA graph, each after the Triton norm that feeds
it (with programmatic dependent launch a Triton GEMM starts streaming its weights while that norm
finishes, cuBLAS does not), on weights that are not L2-resident.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.kernels import cpu_linear

MODES = ("off", "on", "auto")
ELIGIBLE_DTYPES = (torch.bfloat16, torch.float16)
WIN_MARGIN = 0.98  # skinny_gemm must be 2 % faster: a tie within timing noise stays with cuBLAS
# Bump when skinny_gemm or the measurement changes what a stored choice means: caches of another revision
# (or another torch or triton) are ignored.
CACHE_REVISION = 6  # 6: fused split sums among skinny_gemm's candidates; 5: cuBLASLt measured by default
CUBLASLT = "cublaslt"  # the route of a product that F.linear runs with cuBLASLt preferred


@dataclass(frozen=True)
class Choice:
    """The measurement of one shape: skinny_gemm's best config and both times (microseconds)."""

    config: tuple[int, ...]  # SkinnyConfig fields (block_n, block_k, split, num_warps, num_stages)
    skinny_us: float
    cublas_us: float
    # F.linear with cuBLASLt preferred (inf: not measured). Its heuristics pick other kernels at 32-64 rows: on
    # the H200 the down projection ran at 88-90 % of its bytes there against cuBLAS's 78-85 % and the skinny
    # kernel's 85-89 %, gate/up at 64 rows 58.3 us against 60.5 and 62.2 (run 272). In the engine's measurement it
    # also took down and eh_proj at 128 rows (36.9 / 24.3 us against cuBLAS's 40.3 / 26.3), and the 4-token window
    # at batch 32 ran 8.39-8.47 ms against 8.73-8.75 (step_benchmark A/B, run 273).
    cublaslt_us: float = float("inf")

    @property
    def route(self) -> str:
        return self.route_among(cublaslt=True)

    def route_among(self, cublaslt: bool) -> str:
        """'skinny', CUBLASLT or 'cublas': the fastest where it beats cuBLAS by WIN_MARGIN (cuBLASLt only where
        `cublaslt`)."""
        lt = self.cublaslt_us if cublaslt else math.inf
        if min(self.skinny_us, lt) >= WIN_MARGIN * self.cublas_us:
            return "cublas"
        return "skinny" if self.skinny_us <= lt else CUBLASLT

    @property
    def skinny_wins(self) -> bool:
        return self.route == "skinny"


_mode = "auto"
_table: dict[str, Choice] = {}
_cache_loaded = False  # the persistent cache is read once, at the first eligible call
_cache_broken = False  # a cache that could not be written is not tried again
_unfit: set[tuple[tuple[int, ...], int]] = set()  # (config, BLOCK_M) past this device's shared memory


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


def save_table(path: Path, entries: dict[str, Choice], revision: str | None = None) -> None:
    rows = {key: {"config": list(c.config), "skinny_us": c.skinny_us, "cublas_us": c.cublas_us,
                  **({"cublaslt_us": c.cublaslt_us} if math.isfinite(c.cublaslt_us) else {})}
            for key, c in sorted(entries.items())}
    head = {"version": 1} if revision is None else {"version": 1, "revision": revision}
    Path(path).write_text(json.dumps({**head, "entries": rows}, indent=1) + "\n")


def load_table(path: Path, revision: str | None = None, overwrite: bool = True) -> int:
    """Add a gemm_benchmark table (or a cache of `revision`: another revision adds nothing) to the
    dispatch's; overwrite=False keeps the entries it has. -> entries added."""
    data = json.loads(Path(path).read_text())
    if revision is not None and data.get("revision") != revision:
        return 0
    added = 0
    for key, row in data["entries"].items():
        if overwrite or key not in _table:
            _table[key] = Choice(tuple(row["config"]), float(row["skinny_us"]), float(row["cublas_us"]),
                                 float(row.get("cublaslt_us", math.inf)))
            added += 1
    return added


def cache_path() -> Path | None:
    """Where measured choices persist between starts (MTPSERVE_SKINNY_CACHE; empty: nowhere)."""
    raw = os.environ.get("MTPSERVE_SKINNY_CACHE", "~/.cache/mtpserve/skinny_gemm.json")
    return Path(raw).expanduser() if raw else None


def cache_revision() -> str:
    import triton

    return f"{CACHE_REVISION}|torch {torch.__version__}|triton {triton.__version__}"


def _load_cache() -> None:
    """Once per process: the choices this machine measured before (an explicit table's entries win)."""
    global _cache_loaded
    _cache_loaded = True
    path = cache_path()
    if path is None or not path.is_file():
        return
    try:
        load_table(path, cache_revision(), overwrite=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"ignoring the skinny GEMM cache {path}: {exc!r}")


def _persist() -> None:
    """Write the table to the cache, whole: processes of one host (tensor-parallel ranks) may write at once,
    and the last whole file wins. A shape skipped for want of memory is left out: that was this start's."""
    global _cache_broken
    path = cache_path()
    if path is None or _cache_broken:
        return
    measured = {key: c for key, c in _table.items() if c.cublas_us > 0}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_table(tmp, measured, cache_revision())
        os.replace(tmp, path)
    except OSError as exc:
        _cache_broken = True
        with contextlib.suppress(OSError):  # a half-written file, if any, is not left beside the cache
            tmp.unlink(missing_ok=True)
        warnings.warn(f"cannot write the skinny GEMM cache {path} ({exc!r}): shapes are measured again next start")


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
    route = _route_for(x2, weight, bias)
    if route is None:
        return F.linear(x, weight, bias)
    if route == CUBLASLT:
        with cublaslt():
            return F.linear(x, weight, bias)
    return skinny_gemm(x2, weight, bias, SkinnyConfig(*route)).view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def cublaslt() -> Iterator[None]:
    """F.linear inside prefers cuBLASLt (a process-wide flag, read as each product is dispatched: a graph captured
    inside keeps the kernels it chose)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(CUBLASLT)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _route_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...] | str | None:
    """The skinny config to run, CUBLASLT, or None for cuBLAS; measures a new shape when the stream is not
    capturing."""
    from mtpserve.kernels.skinny_gemm import m_bucket

    (rows, k), n = x.shape, weight.shape[0]
    if not _cache_loaded:
        _load_cache()
    key = shape_key(_device_name(x.device), x.dtype, m_bucket(rows), n, k)
    choice = _table.get(key)
    if choice is None and not torch.cuda.is_current_stream_capturing():
        choice = _table[key] = measure(x, weight, bias)
        _persist()
    if choice is None:  # first seen inside a capture (nothing compiled)
        return None
    route = route_taken(choice)
    return choice.config if route == "skinny" else CUBLASLT if route == CUBLASLT else None


def route_taken(choice: Choice) -> str:
    """'skinny', CUBLASLT or 'cublas': where the dispatch sends a measured shape in the current mode."""
    if _mode == "on":
        return "skinny" if choice.config else "cublas"
    return choice.route_among(cublaslt=_cublaslt_allowed()) if _mode == "auto" else "cublas"


def _cublaslt_allowed() -> bool:
    return os.environ.get("MTPSERVE_CUBLASLT", "on") != "off"


def measure(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, reps: int = 5) -> Choice:
    """Time F.linear (with cuBLAS, then with cuBLASLt preferred) and every candidate config as a captured step runs
    them; syncs the device.

    Each is captured CALLS times back to back into one CUDA graph, each call on the next of a few copies
    of the weight (twice the L2 in all, so no call finds its weight cached; at most CALLS), timed per call
    over replays. Timed one call at a time after an L2 eviction instead, cuBLAS had looked as fast as the
    skinny kernel on most 8B shapes, and auto kept it, while in the captured step the skinny kernel on
    every product took the batch-1 step from 6.02 to 5.80 ms (H100, runs 85-86): a call alone also
    pays its launch and ramp, which a graph overlaps with the call before. Each product also follows the
    Triton RMSNorm that makes its input, as in a step: on Hopper the skinny kernel then streams its first
    weight tile while the norm finishes (programmatic dependent launch, kernels/pdl.py) and cuBLAS waits
    for it; alone, the skinny kernel lost shapes that it won inside the default model's step (H100, run
    159: the k = 0 step at batch 8 took 0.23 ms on auto's choice, 0.20 with the skinny kernel forced).
    A serving process has given most of its memory to KV pools: a shape whose copies do not fit is left
    to cuBLAS."""
    from mtpserve.kernels.rmsnorm import rms_norm
    from mtpserve.kernels.skinny_gemm import block_m, candidate_configs, num_sms, skinny_gemm

    (rows, k), n = x.shape, weight.shape[0]
    l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
    copies = min(CALLS, max(1, -(-2 * l2 // (weight.numel() * weight.element_size()))))  # a graph uses CALLS
    ones = torch.ones(k, dtype=x.dtype, device=x.device)
    try:
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        plain = lambda w: F.linear(rms_norm(x, ones, 1e-6), w, bias)  # noqa: E731
        cublas, lt = _replay_us(plain, weights, reps), float("inf")
        if _cublaslt_allowed():
            with cublaslt():
                lt = _replay_us(plain, weights, reps)
    except torch.cuda.OutOfMemoryError:
        warnings.warn(f"no memory to measure {tuple(weight.shape)} at M={rows}: cuBLAS takes it")
        return Choice((), float("inf"), 0.0)
    best: tuple[float, tuple[int, ...]] | None = None
    for cfg in candidate_configs(rows, n, k, num_sms(x.device)):
        tile = (tuple(cfg.as_list()), block_m(rows))
        if tile in _unfit:
            continue
        try:
            us = _replay_us(lambda w: skinny_gemm(rms_norm(x, ones, 1e-6), w, bias, cfg), weights, reps)
        except Exception as exc:
            if type(exc).__name__ == "OutOfResources":  # this device's shared memory: skip that tile from now on
                _unfit.add(tile)
            else:
                warnings.warn(f"skinny_gemm config {cfg} failed for {tuple(weight.shape)} at M={rows}: {exc!r}")
            continue
        if best is None or us < best[0]:
            best = (us, tuple(cfg.as_list()))
    return Choice((), float("inf"), cublas, lt) if best is None else Choice(best[1], best[0], cublas, lt)


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


set_mode(os.environ.get("MTPSERVE_SKINNY_GEMM", "auto"))
if os.environ.get("MTPSERVE_SKINNY_TABLE"):
    load_table(Path(os.environ["MTPSERVE_SKINNY_TABLE"]))
