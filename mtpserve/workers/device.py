"""Host-device copies that do not stall the host.

A plain `torch.tensor(data, device="cuda")` copies from pageable memory, which makes the host wait
for the GPU queue: one hidden sync per small tensor, dozens per step. Staging through pinned memory
(PyTorch caches those buffers) lets the copy run asynchronously on the stream, in order with the
kernels that use it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def to_device(data: np.ndarray | Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else torch.tensor(data)
    host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Staging:
    """A worker's per-step copies through pinned buffers that are reused, not allocated per step.

    No pinned memory, events or device buffers are allocated per step; but on the H100's host that did
    not make a copy cheaper (measured alone: upload 31.6 us, download 30.9 us, against 26.8 us for a
    fresh pinned tensor through `to_device`), since there every torch call costs about 3 us. `upload` writes int64 data into the next pinned buffer of a ring and copies it into one persistent
    device buffer, which is valid until the next upload (the stream orders the kernels that read the
    previous contents before the copy that overwrites them); `download` copies a device tensor of
    8-byte elements into the next pinned buffer and returns it with the event that marks the copy's
    end. A ring buffer is reused only after its last copy ended. A download must also have been read by
    then: the engine reads a step's result before it launches the step after next, and a step downloads
    at most three results (its uniform, prefill and general parts), so depth 8 leaves room. Off CUDA
    both are free: upload wraps the array, download returns the tensor.
    """

    DEPTH = 8

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self._device_buf = torch.empty(0, dtype=torch.int64, device=device)
        self._up, self._down = _PinnedRing(self.DEPTH), _PinnedRing(self.DEPTH)
        self._stamps: list[torch.cuda.Event] = [torch.cuda.Event(enable_timing=True) for _ in range(self.DEPTH)]
        self._next_stamp = 0

    def stamp(self) -> torch.cuda.Event | None:
        """A timing event recorded on the stream now (None off CUDA): with the event `download` returns,
        it times a step's own work on the device; reused DEPTH stamps later, as the download buffers are."""
        if not self.cuda:
            return None
        event = self._stamps[self._next_stamp]
        self._next_stamp = (self._next_stamp + 1) % self.DEPTH
        event.record(self.stream)
        return event

    def upload(self, data: np.ndarray) -> torch.Tensor:
        """int64 data [n] -> a device tensor [n] (valid until the next upload)."""
        if not self.cuda:
            return torch.from_numpy(np.ascontiguousarray(data, dtype=np.int64))
        n = len(data)
        host, i = self._up.take(n)
        host.numpy()[:] = data
        if self._device_buf.numel() < n:
            self._device_buf = torch.empty(max(n, 2 * self._device_buf.numel()), dtype=torch.int64,
                                           device=self._device_buf.device)
        out = self._device_buf[:n]
        out.copy_(host, non_blocking=True)
        self._up.mark(i, self.stream)
        return out

    def download(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A device tensor of int64 or float64 -> (its pinned host copy, the event after the copy)."""
        if not self.cuda:
            return t, None
        host, i = self._down.take(t.numel())
        host = host.view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return host, self._down.mark(i, self.stream)


class _PinnedRing:
    """`depth` pinned int64 buffers taken in turn, each with the event of the last copy that used it."""

    def __init__(self, depth: int) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * depth
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    def take(self, numel: int) -> tuple[torch.Tensor, int]:
        i, self.next = self.next, (self.next + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()  # long done: depth steps ago
        buf = self.bufs[i]
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * (buf.numel() if buf is not None else 0), 256)
            buf = self.bufs[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        return buf[:numel], i

    def mark(self, i: int, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = self.events[i] = self.events[i] or torch.cuda.Event(enable_timing=True)  # a step's end (stamp)
        event.record(stream)
        return event
