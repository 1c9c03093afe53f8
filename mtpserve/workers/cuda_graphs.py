"""CUDA-graph replay of the target forward for decode / verify steps (docs/design.md §6).

Why: a verify step launches ~700 small kernels from Python and the GPU idles between them (an 8B
target at batch 1: 19.5 ms per step against a 3.6 ms memory floor). Replaying a captured graph
launches them all at once.

What is graphed: TargetModel.forward (input ids -> pre-norm hidden states) for steps in which every
scheduled request has the same window w = 1 verified token + w - 1 drafts, 1 <= w <= 9. Prefill
chunks and mixed windows run eagerly.

Padding: R requests run as a bucket of B >= R requests (batch_buckets). Every kernel's grid depends
only on B * w, B and w (paged_attention picks its tile from max_query_len = w and reads seq_lens on
the device), so there is one graph per (B, w), captured on first use. Padded requests keep w queries
but get slot -1 (store_kv skips them: the KV pools are never written), seq_len = w and a block-table
row of zeros (they read block 0, which is harmless: their rows are discarded).

Inputs reach the graph through two flat static device buffers (int64: ids, positions, slots, request
slots; int32: query_start_loc, seq_lens, block tables), each filled by one asynchronous copy from a
pinned staging buffer; the drafts are then gathered into the id rows on the device (they never leave
it).

Lifetime of the output: all graphs share one memory pool, so a replay may overwrite the hidden states
another graph returned. The runner consumes them within the step (verification logits, the drafter's
input rows, the drafter group's blocking send) and the step ends with a device sync, so nothing reads
them after the next replay.

Off CUDA there are no graphs: "capture" records the eager callable and "replay" calls it on the static
buffers, so the padding logic is tested on CPU bit for bit against the eager path.
"""

from __future__ import annotations

import gc
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS
from mtpserve.workers.attention import AttentionMetadata, LayerKV
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.state import CachedRequest

MAX_WINDOW = 1 + MAX_SPECULATIVE_TOKENS
WARMUP_RUNS = 2  # before capture: Triton compiles, cuBLAS picks its kernels, the allocator settles
T = TypeVar("T")


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ... below max_num_seqs, then max_num_seqs."""
    return growing_buckets((1, 2, 4, 8), max_num_seqs)


def growing_buckets(small: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """`small` (powers of two), then 2x its last, 3x, 4x, 6x, 8x, ... (steps of x1.5 and x4/3: padding wastes
    at most a third) below `limit`, then `limit` itself."""
    sizes, b = list(small), 2 * small[-1]
    while sizes[-1] < limit:
        sizes += [b, b * 3 // 2]
        b *= 2
    return tuple(s for s in sizes if s < limit) + (limit,)


def capture_graph(fn: Callable[[], T], pool: tuple[int, int] | None, device: torch.device
                  ) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm fn up on a side stream, then capture it into a graph of `pool` -> (graph, fn's static output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):  # Triton compiles, cuBLAS picks kernels, the allocator settles
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a server's event loop) must not abort the capture. Nor may
    # the garbage collector: a graph it frees meanwhile (an old runner's) resets its executable graph, which
    # is not permitted while a stream captures, and the capture fails (seen on the H100 in the CUDA tests).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class StaticStep:
    """One (bucket, window) graph: its static inputs, the captured forward and its static output."""

    def __init__(self, batch: int, window: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.batch, self.window, self.max_blocks, self.block_size = batch, window, max_blocks, block_size
        t = batch * window
        self.i64 = torch.zeros(3 * t + batch, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(2 * batch + 1 + batch * max_blocks, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self.host64 = torch.zeros(self.i64.shape, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(self.i32.shape, dtype=torch.int32, pin_memory=pinned)
        self.input_ids, self.positions, slot_mapping, self.req_slots = self.i64.split([t, t, t, batch])
        qsl, seq_lens, tables = self.i32.split([batch + 1, batch, batch * max_blocks])
        self.meta = AttentionMetadata(qsl, seq_lens, tables.view(batch, max_blocks), slot_mapping,
                                      max_query_len=window, max_seq_len=window)
        self.host32.numpy()[: batch + 1] = np.arange(batch + 1) * window  # query_start_loc never changes
        self._copied = torch.cuda.Event() if pinned else None
        self.fn: Callable[[], torch.Tensor] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def load(self, reqs: Sequence[CachedRequest], starts: np.ndarray, draft_tokens: torch.Tensor | None) -> None:
        """Copy this step's inputs, padding rows included, into the static buffers (no host sync)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the staging buffers has finished
        self._stage(reqs, starts)
        self.i64.copy_(self.host64, non_blocking=True)
        self.i32.copy_(self.host32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        r, w = len(reqs), self.window
        if w > 1 and r > 0:  # the drafts of request i fill its rows 1 .. w-1
            self.input_ids.view(self.batch, w)[:r, 1:] = draft_tokens[self.req_slots[:r], : w - 1]

    def _stage(self, reqs: Sequence[CachedRequest], starts: np.ndarray) -> None:
        """Fill the host staging buffers: R real requests, then padding up to the bucket."""
        r, b, w, bs = len(reqs), self.batch, self.window, self.block_size
        ids, pos, slots, req_slots = np.split(self.host64.numpy(), np.cumsum([b * w] * 3))
        seq_lens, tables = np.split(self.host32.numpy()[b + 1:], [b])
        tables, pos = tables.reshape(b, self.max_blocks), pos.reshape(b, w)
        pos[:] = np.arange(w)
        pos[:r] += starts[:, None]
        seq_lens[:] = w
        seq_lens[:r] = starts + w
        tables[:] = 0
        for i, req in enumerate(reqs):
            tables[i, : len(req.block_ids[0])] = req.block_ids[0]
        slots[:] = -1
        blocks = tables[np.arange(r)[:, None], pos[:r] // bs].astype(np.int64)
        slots.reshape(b, w)[:r] = blocks * bs + pos[:r] % bs
        ids[:] = 0
        ids.reshape(b, w)[:r, 0] = [req.token_ids[s] for req, s in zip(reqs, starts.tolist())]  # the verified token
        req_slots[:] = 0
        req_slots[:r] = [req.slot for req in reqs]
        self.meta.max_seq_len = int(seq_lens.max())  # read by the CPU reference only; graphs ignore it

    def capture(self, fn: Callable[[], torch.Tensor], pool: tuple[int, int] | None) -> None:
        self.fn = fn
        device = self.i64.device
        if device.type != "cuda":
            return  # replay calls fn eagerly on the static buffers
        self.load([], np.zeros(0, dtype=np.int64), None)  # all rows padding: warm-up and capture write no KV
        self.graph, self.out = capture_graph(fn, pool, device)

    def replay(self, num_reqs: int) -> torch.Tensor:
        """-> hidden states of the real requests' rows, [num_reqs * window, hidden]."""
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self.fn()
        return out[: num_reqs * self.window]


class TargetGraphs:
    """Decides which steps replay a graph, captures graphs lazily per (bucket, window), replays them."""

    def __init__(self, target: TargetModel, kv: list[LayerKV], max_num_seqs: int, block_size: int,
                 max_model_len: int, device: torch.device) -> None:
        self.target, self.kv, self.block_size, self.device = target, kv, block_size, device
        self.buckets = batch_buckets(max_num_seqs)
        # Fixed width: every table the scheduler hands out covers at most max_model_len plus draft slack.
        self.max_blocks = -(-(max_model_len + 2 * MAX_SPECULATIVE_TOKENS) // block_size)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.steps: dict[tuple[int, int], StaticStep] = {}
        self.replays = 0
        self.on_capture: Callable[[], None] | None = None  # told before a capture (it may compile for seconds)

    def window(self, reqs: Sequence[CachedRequest], n: np.ndarray, d: np.ndarray) -> int | None:
        """The common window of a pure decode / verify step, or None: the step runs eagerly."""
        if not reqs or len(reqs) > self.buckets[-1] or (n != 1).any() or (d != d[0]).any():
            return None
        w = 1 + int(d[0])
        if w > MAX_WINDOW or any(len(r.block_ids[0]) > self.max_blocks for r in reqs):
            return None
        return w

    @torch.inference_mode()
    def run(self, reqs: Sequence[CachedRequest], starts: np.ndarray, n: np.ndarray, d: np.ndarray,
            draft_tokens: torch.Tensor) -> torch.Tensor | None:
        """Pre-norm hidden states [R * w, H] of an eligible step (valid until the next replay), else None."""
        w = self.window(reqs, n, d)
        if w is None:
            return None
        bucket = next(b for b in self.buckets if b >= len(reqs))
        step = self.steps.get((bucket, w)) or self._capture(bucket, w)
        step.load(reqs, starts, draft_tokens)
        self.replays += 1
        return step.replay(len(reqs))

    def _capture(self, bucket: int, w: int) -> StaticStep:
        if self.on_capture is not None:
            self.on_capture()
        step = StaticStep(bucket, w, self.max_blocks, self.block_size, self.device)
        step.capture(lambda: self.target(step.input_ids, step.positions, step.meta, self.kv), self.pool)
        self.steps[(bucket, w)] = step
        return step
