"""The drafter group (docs/design.md §2): MTP modules on their own devices, fed by the target ranks.

One torch.distributed process group spans the replica: target ranks 0..tp-1, then drafter ranks
tp..tp+G-1; module k lives on drafter rank tp + k mod G (mtpserve/workers/group_links.py). Every process
applies the same StepPlans and splits each step alike (`at_frontier`): the requests at their frontier
take the uniform step, the others (prompt chunks) the general path. So every rank knows each tensor's
shape without being told, and only tensors travel, point to point. Per step, its uniform part first:

  1. target rank 0 -> every drafter: the packed result [B, 1 + w] (accepted count, window tokens), which
     each drafter commits to its device state as the target did (length, newest token, penalty counts);
  2. target rank 0 -> module 0's owner: the rows module 0 reads [B, w, H];
  3. the uniform chain (mtpserve/workers/uniform_chain.py) runs each module on its owner, which hands the
     next owner its output rows and the drafts (and proposals) so far;
  4. the holder of the chain's last step -> every target rank: the drafts [B, k] (with their top-M
     proposals unless the batch is greedy), which the target ranks store in their slots.
Then the general part, host-planned as before: the emitted tokens [F, 2 + K], the target hidden rows
[T, H], the general Drafter's own hand-overs, its drafts. A drafter takes in every input of a step
before it sends anything, so no two ranks wait on each other. Target ranks receive the drafts after
rank 0 answered the scheduler, so drafting overlaps the control path.

A drafter's host view of a request stops at its first uniform step: uniform steps advance only the device
state, which is all the chain reads, and leave a request at its frontier whatever it accepted, so every
rank still splits later steps alike. Without adaptive speculation (off with a group) nothing sends a
request back to the general path but its re-admission (preemption, recovery), which brings its tokens.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.attention import LayerKV
from mtpserve.workers.device import Staging
from mtpserve.workers.drafter import Drafter, TargetRows
from mtpserve.workers.drafter_steps import DrafterSteps, KeptDelivery
from mtpserve.workers.group_links import (GroupChainLink, Topology, UniformGroupLink, draft_buffers, recv, send,
                                          unpack_drafts)
from mtpserve.workers.kv_cache import layer_pool
from mtpserve.workers.model_runner import RunnerConfig
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.loader import LoadedModel
from mtpserve.workers.slot_state import SamplingFlags, StateDiffs, device_state
from mtpserve.workers.state import (CachedRequest, SlotBuffers, StepLayout, apply_plan, at_frontier, record_emitted,
                                    subset)
from mtpserve.workers.uniform_batch import UniformBatch, UniformBatches
from mtpserve.workers.uniform_chain import UniformChain
from mtpserve.workers.uniform_step import StepShape


def _emitted_width(lay: StepLayout) -> int:
    return int(max((d for d, f in zip(lay.d.tolist(), lay.final) if f), default=0)) + 2


class TargetDraftLink:
    """The target ranks' side: rank 0 feeds the group; every target rank takes the drafts back."""

    def __init__(self, topo: Topology, rank: int, top_m: int, device: torch.device) -> None:
        self.topo, self.rank, self.top_m, self.device = topo, rank, top_m, device
        self.feeds = rank == 0
        # Drafts due this step, a part at a time: (slots [R] on the device, k, greedy, source rank).
        self._due: list[tuple[torch.Tensor, int, bool, int]] = []

    def send_uniform(self, packed: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor,
                     shape: StepShape) -> None:
        if not shape.chain:  # nothing to draft: the group sits the step out (DrafterRunner._take_uniform)
            return
        if self.feeds:
            for g in range(self.topo.drafters):
                send([packed], self.topo.tp + g)
            send([rows], self.topo.owner(0))
        self._due.append((slots, shape.chain, shape.flags.all_greedy, self.topo.holder(shape.chain)))

    def send(self, reqs: list[CachedRequest], lay: StepLayout, result: StepResult, rows: TargetRows) -> None:
        runs = self.topo.chain_runs(reqs)
        if self.feeds:
            if result.req_ids:
                emitted = _pack_emitted(result, _emitted_width(lay), self.device)
                for g in range(self.topo.drafters):
                    send([emitted], self.topo.tp + g)
            if runs:
                send([rows.hidden], self.topo.owner(0))
        drafting = [r for r, f in zip(reqs, lay.final) if f and r.num_spec > 0]
        if runs and drafting:
            slots = torch.tensor([r.slot for r in drafting], device=self.device)
            k, src = max(r.num_spec for r in drafting), self.topo.holder(max(r.num_spec for r in reqs))
            self._due.append((slots, k, False, src))

    def receive(self, slots: SlotBuffers) -> None:
        for idx, k, greedy, src in self._due:
            slots.put_drafts(idx, *unpack_drafts(recv(draft_buffers(len(idx), k, self.top_m, greedy, self.device),
                                                      src)))
        self._due = []


class DrafterRunner:
    """A drafter rank: the device state a single-process runner keeps for the modules it owns (from the same
    plans and the target's results), their KV groups, and its part of each step's chain."""

    def __init__(self, model: LoadedModel, config: RunnerConfig, topo: Topology, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        cfg, modules = model.config, config.num_mtp_modules
        self.config, self.topo, self.rank, self.dtype, self.device = config, topo, rank, dtype, device
        self.hidden = cfg.hidden_size
        self.slots = SlotBuffers(config.max_num_seqs, modules, cfg.hidden_size, cfg.vocab_size,
                                 config.draft_top_m, dtype, device)
        kv = [_module_pool(cfg, config, dtype, device) if topo.owner(m) == rank else _no_pool(device)
              for m in range(modules)]
        embed, head = model.target.embed_tokens, model.target.lm_head
        link = GroupChainLink(topo, rank, cfg.hidden_size, dtype, config.draft_top_m, device)
        self.drafter = Drafter(model.mtp, embed, head, kv, self.slots, config.block_size, config.chain_mode,
                               config.draft_top_m, cfg.vocab_size, link)
        self.diffs: StateDiffs | None = None
        self.chain: UniformChain | None = None  # the uniform step's chain (None: every step takes the general path)
        self.steps: DrafterSteps | None = None  # this rank's part of uniform steps, at fixed shapes (drafter_steps.py)
        self.staging = Staging(device)
        if config.uniform_steps:
            max_len = config.max_model_len or cfg.max_position
            self.state, self.diffs = device_state(config.max_num_seqs, 1 + modules, max_len, config.block_size,
                                                  cfg.vocab_size, device)
            kept = KeptDelivery(UniformGroupLink(topo, rank, config.draft_top_m) if topo.drafters > 1 else None)
            self.chain = UniformChain(model.mtp, embed, head, kv, self.slots, self.state, config.chain_mode,
                                      config.draft_top_m, modules, kept)
            self.steps = DrafterSteps(self.chain, kept, self.state, self.slots, self.staging, config.max_num_seqs,
                                      cfg.hidden_size, dtype, device, config.cuda_graphs, topo.owner(0) == rank,
                                      config.pad_uniform_steps)
            # The shapes with a chain that the target captures at start, prepared here at start too.
            self.steps.prepare([StepShape(1 + k, k, SamplingFlags(all_greedy=greedy))
                                for k in config.capture_at_start if k > 0 for greedy in (True, False)])
        self.batches = UniformBatches(cfg.vocab_size)
        self.requests: dict[str, CachedRequest] = {}
        self._device_only: set[str] = set()  # requests whose host view stopped (module docstring)
        self._last_batch: UniformBatch | None = None
        self.num_uniform_steps = 0  # steps whose uniform part ran here (tests read it)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> None:
        modules = self.config.num_mtp_modules
        apply_plan(self.requests, self.slots, plan, modules, self.diffs)
        if plan.freed_ids or plan.new_requests:
            self.batches.forget()
            self._device_only.difference_update(plan.freed_ids)
        reqs = [self.requests[r] for r in plan.req_ids]
        if not reqs:
            return
        fast = at_frontier(reqs, plan, modules) if self.chain is not None else [False] * len(reqs)
        uniform = self._take_uniform(*subset(reqs, plan, fast, True)) if any(fast) else None
        general = self._take_general(*subset(reqs, plan, fast, False)) if not all(fast) else None
        if uniform is not None:
            uniform()
            self.num_uniform_steps += 1
        if general is not None:
            self.drafter.run(*general)

    def _take_uniform(self, reqs: list[CachedRequest], plan: StepPlan) -> Callable[[], None]:
        """Take in the uniform part's inputs now (every input of a step comes in before anything is sent): its
        slots (with the state diffs: one copy), the packed result and, on module 0's owner, the rows module 0
        reads. -> what runs the part."""
        batch = self.batches.of(reqs, plan.req_ids)
        if batch is not self._last_batch:  # a new batch: its requests' host view stops here
            self._device_only.update(batch.req_ids)
            self._last_batch = batch
        shape = StepShape.of(reqs, plan, batch.flags, self.config.num_mtp_modules)
        if not shape.chain:
            # Nothing to draft, and nothing is sent: each step would hold the target's stream on a rendezvous with
            # this rank for nothing (a k = 0 request alone in a group replica ran at 0.06-0.08 of in-process on two
            # H200s). The state diffs wait for the next upload; the rows of these requests fall behind, which
            # only they read, and a request's k is fixed in a group replica (no adaptive k, design §9): if one
            # shares a later step with drafting requests, its stale rows draft tokens that it never verifies.
            return lambda: None
        steps, tp = self.steps, self.topo.tp
        static, r = steps.take(batch.slots, shape, self.diffs)
        return lambda: steps.run(static, r, shape, tp)

    def _take_general(self, reqs: list[CachedRequest], plan: StepPlan
                      ) -> tuple[list[CachedRequest], list[bool], TargetRows] | None:
        """The general part's inputs: the emitted tokens (recorded at once) and, on module 0's owner, the target
        hidden rows; None when no chain runs."""
        if self._device_only.intersection(plan.req_ids):
            raise RuntimeError("a request that took uniform steps came back to the general path without being "
                               "re-admitted: this drafter rank no longer knows its tokens")
        lay = StepLayout.of(reqs, plan)
        sampled = [r for r, f in zip(reqs, lay.final) if f]
        if sampled:
            buf = torch.empty(len(sampled), _emitted_width(lay), dtype=torch.long, device=self.device)
            rows = recv([buf], 0)[0].tolist()
            record_emitted(sampled, [row[1 : row[0] + 2] for row in rows], self.slots, self.diffs)
        lay.advance_unfinished(reqs)
        if not self.topo.chain_runs(reqs):
            return None
        hidden = None
        if self.topo.owner(0) == self.rank:
            total = int((lay.n + lay.d).sum())
            hidden = recv([torch.empty(total, self.hidden, dtype=self.dtype, device=self.device)], 0)[0]
        return reqs, lay.final, TargetRows(hidden, lay.first_row, lay.starts)

    def submit(self, plan: StepPlan) -> None:
        """A launched (overlapped) step: as `execute`, a drafter rank hands nothing back to the driver."""
        self.execute(plan)

    @property
    def num_graph_replays(self) -> int:
        """Uniform parts replayed from CUDA graphs (tests read it)."""
        return self.steps.replays if self.steps is not None else 0

    def finish_step(self) -> None:
        pass


def _module_pool(cfg: ModelConfig, config: RunnerConfig, dtype: torch.dtype, device: torch.device) -> LayerKV:
    return layer_pool(cfg, config.num_blocks, config.block_size, dtype, device)


def _no_pool(device: torch.device) -> LayerKV:
    return LayerKV(torch.empty(0, device=device), torch.empty(0, device=device))


def _pack_emitted(result: StepResult, width: int, device: torch.device) -> torch.Tensor:
    out = np.zeros((len(result.req_ids), width), dtype=np.int64)
    for i, (a, tokens) in enumerate(zip(result.num_accepted, result.token_ids)):
        out[i, 0] = a
        out[i, 1 : 1 + len(tokens)] = tokens
    return torch.from_numpy(out).to(device)
