"""Runs uniform steps: one pinned host-to-device copy in, CUDA-graph replay (eager off CUDA), one result.

Per step the host sends one int64 buffer (through the Staging of mtpserve/workers/device.py): the
batch's slots and drafts to verify (padded to the bucket with the pad slot and 0 drafts), followed by
the state diffs since the last step. The diffs are
scattered into DeviceState, the slots and drafts are copied into the static inputs of the graph of
(bucket, StepShape), and the graph replays the whole step (mtpserve/workers/uniform_step.py).

Graphs are captured lazily on first use, after warm-up runs, all in one memory pool. During warm-up
and capture every row is a pad row, so nothing but the pad slot's own state changes. A replay's
outputs live in the pool until the next replay: the runner reads them within the step.

Off CUDA the same step runs eagerly at the batch's own size (padding only costs time there; tests
force it through `pad_to_buckets` to check that padded rows change nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mtpserve.workers.cuda_graphs import batch_buckets, capture_graph
from mtpserve.workers.device import Staging
from mtpserve.workers.slot_state import DeviceState, StateDiffs
from mtpserve.workers.uniform_step import StepShape, UniformStep


@dataclass
class _Graph:
    inputs: torch.Tensor  # [2, B] static input: slots, then drafts to verify
    graph: torch.cuda.CUDAGraph
    out: tuple[torch.Tensor, torch.Tensor]


class UniformGraphs:
    def __init__(self, step: UniformStep, state: DeviceState, staging: Staging, max_num_seqs: int,
                 device: torch.device, use_graphs: bool, pad_to_buckets: bool | None = None) -> None:
        self.step, self.state, self.staging, self.device = step, state, staging, device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pad = self.use_graphs if pad_to_buckets is None else pad_to_buckets
        self.buckets = batch_buckets(max_num_seqs)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[tuple[int, StepShape], _Graph] = {}
        self.runs = self.replays = 0  # uniform steps run, and of those replayed from graphs
        self.on_capture: Callable[[], None] | None = None  # told before a capture (it may compile for seconds)
        self.began: torch.cuda.Event | None = None  # stamped before the last step's forward (None off CUDA)

    @torch.inference_mode()
    def run(self, slots: np.ndarray, num_drafts: np.ndarray, shape: StepShape, diffs: StateDiffs
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (packed [R, 1 + w], raw logits [R * w, V]) for the R real requests (valid until the next step)."""
        r = len(slots)
        self.runs += 1
        batch = next(b for b in self.buckets if b >= r) if self.pad else r
        head = np.empty(2 * batch, dtype=np.int64)
        head[:batch], head[batch:] = self.state.pad_slot, 0
        head[:r], head[batch : batch + r] = slots, num_drafts
        host, counts = diffs.pack(head)
        packed = self.staging.upload(host)  # the step's one host-to-device copy
        self.state.apply(packed[2 * batch :], counts)
        # The step's device share (design §9) starts here: from the stamp at the step's start it would also
        # hold the host's launch work above, while the GPU waited for it, and count the host twice.
        self.began = self.staging.stamp()
        if not self.use_graphs:
            out, raw = self.step(packed[:batch], packed[batch : 2 * batch], shape)
        else:
            g = self.graphs.get((batch, shape)) or self._capture(batch, shape)
            g.inputs.view(-1).copy_(packed[: 2 * batch])
            g.graph.replay()
            out, raw = g.out
            self.replays += 1
        return out[:r], raw[: r * shape.window]

    def capture_all(self, shapes: list[StepShape]) -> None:
        """Capture every batch bucket's graph of each shape now (at start, before requests wait on it)."""
        for batch in self.buckets:
            for shape in shapes:
                if (batch, shape) not in self.graphs:
                    self._capture(batch, shape)

    def _capture(self, batch: int, shape: StepShape) -> _Graph:
        if self.on_capture is not None:
            self.on_capture()
        inputs = torch.zeros(2, batch, dtype=torch.int64, device=self.device)
        inputs[0] = self.state.pad_slot
        graph, out = capture_graph(lambda: self.step(inputs[0], inputs[1], shape), self.pool, self.device)
        g = self.graphs[(batch, shape)] = _Graph(inputs, graph, out)
        return g
