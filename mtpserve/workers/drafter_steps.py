"""The drafter group's part of a uniform step at fixed shapes (docs/design.md §2, §8): padded to batch buckets on a
GPU and prepared at start, for the shapes the target captures there. A drafter rank that holds every module of the
chain (G == 1) replays its part from CUDA graphs; with several drafter ranks the chain changes hands inside a
step (NCCL between the passes, which no graph holds), so their part runs eagerly, once on pad rows at start.

Run eagerly at each batch's own size instead, a drafter rank compiled Triton kernels for sizes it met while
serving and launched every kernel of the chain from Python: on two H200s (benchmarks/ray_gpu.py, k = 3, the
default model) one step outlasted the executor's hang limit, and once warm the group ran at 0.01-0.04 of the
in-process engine's tok/s.

Per step: the batch's slots (padded with the pad slot) and the state diffs go up in one copy; the target's
packed result [R, 1 + w] and module 0's rows [R, w, H] arrive over NCCL into the first R rows of the step's
static inputs (pad rows hold zeros and commit to the pad slot, which owns no KV); the step commits and runs the
chain (handing it on between drafter ranks, padded rows too); the holder of its last step then sends the first R
rows' drafts to every target rank, outside any graph (nothing is sent inside one, design §2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mtpserve.workers.cuda_graphs import batch_buckets, capture_graph
from mtpserve.workers.device import Staging
from mtpserve.workers.group_links import UniformGroupLink, draft_payload, recv, send
from mtpserve.workers.slot_state import DeviceState, StateDiffs
from mtpserve.workers.state import SlotBuffers
from mtpserve.workers.uniform_chain import ChainRun, UniformChain
from mtpserve.workers.uniform_step import StepShape, commit


class KeptDelivery:
    """The chain's link in a drafter rank: hand-overs go through the group's link (none where this rank holds every
    module), and the finished drafts are kept (in a graph, its static outputs) for the runner to send to the target
    ranks once the step has run."""

    def __init__(self, group: UniformGroupLink | None) -> None:
        self.group = group  # None: this rank holds every module
        self.payload: list[torch.Tensor] = []

    def owns(self, module: int) -> bool:
        return self.group is None or self.group.owns(module)

    def take_over(self, run: ChainRun, j: int) -> None:
        self.group.take_over(run, j)

    def hand_over(self, run: ChainRun, j: int) -> None:
        self.group.hand_over(run, j)

    def deliver(self, run: ChainRun) -> None:
        self.payload = draft_payload(*run.stacked())


@dataclass
class _Static:
    """One (bucket, shape) step: its inputs at fixed addresses, its graph (None: run eagerly) and its drafts."""

    slots: torch.Tensor  # [B]
    packed: torch.Tensor  # [B, 1 + w] accepted count, then the window's tokens
    rows: torch.Tensor | None  # [B, w, H] module 0's input rows (None: module 0 is on another drafter rank)
    graph: torch.cuda.CUDAGraph | None = None
    payload: list[torch.Tensor] = field(default_factory=list)  # the B rows' drafts (and proposals); [] but on
    # the holder of the chain's last step


class DrafterSteps:
    def __init__(self, chain: UniformChain, kept: KeptDelivery, state: DeviceState, buffers: SlotBuffers,
                 staging: Staging, max_num_seqs: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 use_graphs: bool, takes_rows: bool, pad_to_buckets: bool | None = None) -> None:
        self.chain, self.kept, self.state, self.buffers, self.staging = chain, kept, state, buffers, staging
        self.hidden, self.dtype, self.device, self.takes_rows = hidden, dtype, device, takes_rows
        self.use_graphs = use_graphs and device.type == "cuda" and kept.group is None
        self.pad = device.type == "cuda" if pad_to_buckets is None else pad_to_buckets
        self.buckets = batch_buckets(max_num_seqs)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps: dict[tuple[int, StepShape], _Static] = {}
        self.replays = 0  # steps replayed from graphs (tests read it)

    def take(self, slots: np.ndarray, shape: StepShape, diffs: StateDiffs) -> tuple[_Static, int]:
        """For a shape with a chain (a step that drafts nothing sends the group nothing): upload the batch's slots
        and the state diffs, then receive target rank 0's packed result (and, on module 0's owner, its rows) into
        a static step's first rows -> (the step, the batch's size R)."""
        r = len(slots)
        batch = next(b for b in self.buckets if b >= r) if self.pad else r
        head = np.full(batch, self.state.pad_slot, dtype=np.int64)
        head[:r] = slots
        s = self.steps.get((batch, shape)) or self._build(batch, shape)
        s.slots.copy_(self.state.upload(self.staging, head, diffs))
        recv([s.packed[:r]], 0)
        if r < batch:  # rows a larger batch left: the pad rows commit nothing but zeros
            s.packed[r:].zero_()
        if s.rows is not None:
            recv([s.rows[:r]], 0)
        return s, r

    def run(self, s: _Static, r: int, shape: StepShape, target_ranks: int) -> None:
        """Commit and draft, then send the first r rows' drafts to every target rank."""
        if s.graph is not None:
            s.graph.replay()
            self.replays += 1
        else:
            s.payload = self._step(s, shape)
        for rank in range(target_ranks if s.payload else 0):
            send([p[:r] for p in s.payload], rank)

    def prepare(self, shapes: list[StepShape]) -> None:
        """At start, where steps are padded: every batch bucket's step of each shape captured, or run once on pad
        rows (every drafter rank in the same order, so that their hand-overs pair up): kernels compile now, not
        inside a served step (one that compiled outlasted the executor's hang limit)."""
        for batch in self.buckets if self.pad else ():
            for shape in shapes:
                if (batch, shape) not in self.steps:
                    s = self._build(batch, shape)
                    if s.graph is None:
                        self._step(s, shape)

    def _build(self, batch: int, shape: StepShape) -> _Static:
        w = shape.window
        rows = torch.zeros(batch, w, self.hidden, dtype=self.dtype, device=self.device) if self.takes_rows else None
        s = _Static(torch.full((batch,), self.state.pad_slot, dtype=torch.long, device=self.device),
                    torch.zeros(batch, 1 + w, dtype=torch.long, device=self.device), rows)
        if self.use_graphs:  # warmed up and captured on pad rows only, as the target's steps are
            s.graph, s.payload = capture_graph(lambda: self._step(s, shape), self.pool, self.device)
        self.steps[(batch, shape)] = s
        return s

    def _step(self, s: _Static, shape: StepShape) -> list[torch.Tensor]:
        st, self.kept.payload = self.state, []
        st.reset_pad()
        accepted, tokens = s.packed[:, 0], s.packed[:, 1:]
        seq_len = st.seq_len[s.slots]
        frontier = commit(st, self.buffers, s.slots, seq_len, accepted, tokens, shape.flags)
        self.chain(s.slots, seq_len, frontier, accepted, tokens, s.rows, shape, st.sampling(s.slots, shape.flags))
        return self.kept.payload
