"""The drafter group (docs/design.md §2): MTP modules on their own devices, fed by the target ranks.

One torch.distributed process group spans the replica: target ranks 0..tp-1, then drafter ranks
tp..tp+G-1; module k lives on drafter rank tp + k mod G. Every process applies the same StepPlans, so
all of them know every request's layout and every tensor's shape without being told: only tensors
travel, point to point, with no shape headers.

Per step, after the target verified:
  1. target rank 0 -> every drafter: the emitted tokens, [F, 2 + K] (accepted count, then tokens);
  2. target rank 0 -> module 0's owner: the target hidden rows of the step, [T, H];
  3. module m's owner -> module m+1's owner, where they differ: m's output rows and the drafts so far;
  4. the owner of the chain's last module -> every target rank: draft tokens with their top-M proposals,
     which the target ranks store in their slots for the next verification.
Target ranks receive (4) after rank 0 answered the scheduler, so drafting overlaps the control path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.attention import LayerKV
from mtpserve.workers.chain import chain_steps
from mtpserve.workers.drafter import Drafter, TargetRows, _Chain
from mtpserve.workers.kv_cache import layer_pool
from mtpserve.workers.models.loader import LoadedModel
from mtpserve.workers.state import CachedRequest, SlotBuffers, StepLayout, apply_plan, record_emitted


@dataclass(frozen=True)
class Topology:
    tp: int
    drafters: int  # G >= 1
    num_modules: int  # MTP modules in use
    chain_mode: str

    @property
    def world(self) -> int:
        return self.tp + self.drafters

    def owner(self, module: int) -> int:
        """Global rank of the drafter holding `module` and its KV group."""
        return self.tp + module % self.drafters

    def holder(self, max_spec: int) -> int:
        """Who holds the finished chain: the owner of the module of its last step."""
        return self.owner(chain_steps(max_spec, self.num_modules, self.chain_mode)[-1].module)

    def chain_runs(self, reqs: list[CachedRequest]) -> bool:
        return self.num_modules > 0 and max((r.num_spec for r in reqs), default=0) > 0


def _send(tensors: list[torch.Tensor], dst: int) -> None:
    for t in tensors:
        if t.numel():
            dist.send(t.contiguous(), dst)


def _recv(tensors: list[torch.Tensor], src: int) -> list[torch.Tensor]:
    for t in tensors:
        if t.numel():
            dist.recv(t, src)
    return tensors


def _emitted_width(lay: StepLayout) -> int:
    return int(max((d for d, f in zip(lay.d.tolist(), lay.final) if f), default=0)) + 2


def _drafting(reqs: list[CachedRequest], final: list[bool]) -> list[CachedRequest]:
    return [r for r, f in zip(reqs, final) if f and r.num_spec > 0]


class TargetDraftLink:
    """The target ranks' side: rank 0 feeds the group; every target rank takes the drafts back."""

    def __init__(self, topo: Topology, rank: int, top_m: int, device: torch.device) -> None:
        self.topo, self.rank, self.top_m, self.device = topo, rank, top_m, device
        self._expect: tuple[list[int], int, int] | None = None  # (slots, K, source rank) of pending drafts

    def send(self, reqs: list[CachedRequest], lay: StepLayout, result: StepResult, rows: TargetRows) -> None:
        runs = self.topo.chain_runs(reqs)
        if self.rank == 0:
            if result.req_ids:
                emitted = _pack_emitted(result, _emitted_width(lay), self.device)
                for g in range(self.topo.drafters):
                    _send([emitted], self.topo.tp + g)
            if runs:
                _send([rows.hidden], self.topo.owner(0))
        drafting = _drafting(reqs, lay.final)
        self._expect = None
        if runs and drafting:
            k = max(r.num_spec for r in drafting)
            self._expect = ([r.slot for r in drafting], k, self.topo.holder(max(r.num_spec for r in reqs)))

    def receive(self, slots: SlotBuffers) -> None:
        if self._expect is None:
            return
        slot_list, k, src = self._expect
        self._expect = None
        ids, probs = _recv(_chain_buffers(len(slot_list), k, self.top_m, self.device), src)
        idx = torch.tensor(slot_list, device=self.device)
        slots.draft_tokens[idx, :k] = ids[..., 0]
        slots.q_ids[idx, :k] = ids[..., 1:]
        slots.q_probs[idx, :k] = probs


class GroupChainLink:
    """The Drafter's view of the group: which modules are here, and how the chain moves between ranks."""

    def __init__(self, topo: Topology, rank: int, hidden: int, dtype: torch.dtype, top_m: int,
                 device: torch.device) -> None:
        self.topo, self.rank, self.hidden, self.dtype, self.top_m, self.device = topo, rank, hidden, dtype, top_m, device

    def owns(self, module: int) -> bool:
        return self.topo.owner(module) == self.rank

    def hand_over(self, to_module: int, nh: torch.Tensor, chain: _Chain) -> None:
        _send([nh, *_pack_chain(chain)], self.topo.owner(to_module))

    def take_over(self, from_module: int, rows: int, chain: _Chain, j: int) -> torch.Tensor:
        nh = torch.empty(rows, self.hidden, dtype=self.dtype, device=self.device)
        bufs = _chain_buffers(len(chain.drafting), chain.tokens.shape[1], self.top_m, self.device)
        _, ids, probs = _recv([nh, *bufs], self.topo.owner(from_module))
        if chain.drafting:
            chain.adopt(ids[..., 0], ids[..., 1:], probs, j)
        return nh

    def deliver(self, last_module: int, chain: _Chain) -> None:
        if chain.drafting:
            packed = _pack_chain(chain)
            for target_rank in range(self.topo.tp):
                _send(packed, target_rank)


class DrafterRunner:
    """A drafter rank: the target's per-request state (from the same plans and the emitted tokens),
    the KV groups of the modules it owns, and its part of the chain."""

    def __init__(self, model: LoadedModel, config, topo: Topology, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        cfg = model.config
        self.config, self.topo, self.rank, self.dtype, self.device = config, topo, rank, dtype, device
        self.hidden = cfg.hidden_size
        self.slots = SlotBuffers(config.max_num_seqs, config.num_mtp_modules, cfg.hidden_size, cfg.vocab_size,
                                 config.draft_top_m, dtype, device)
        kv = [_module_pool(cfg, config, dtype, device) if topo.owner(m) == rank else _no_pool(device)
              for m in range(config.num_mtp_modules)]
        link = GroupChainLink(topo, rank, cfg.hidden_size, dtype, config.draft_top_m, device)
        self.drafter = Drafter(model.mtp, model.target.embed_tokens, model.target.lm_head, kv, self.slots,
                               config.block_size, config.chain_mode, config.draft_top_m, cfg.vocab_size, link)
        self.requests: dict[str, CachedRequest] = {}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> None:
        apply_plan(self.requests, self.slots, plan, self.config.num_mtp_modules)
        reqs = [self.requests[r] for r in plan.req_ids]
        if not reqs:
            return
        lay = StepLayout.of(reqs, plan)
        sampled = [r for r, f in zip(reqs, lay.final) if f]
        if sampled:
            buf = torch.empty(len(sampled), _emitted_width(lay), dtype=torch.long, device=self.device)
            rows = _recv([buf], 0)[0].tolist()
            record_emitted(sampled, [row[1 : row[0] + 2] for row in rows], self.slots)
        lay.advance_unfinished(reqs)
        if not self.topo.chain_runs(reqs):
            return
        hidden = None
        if self.topo.owner(0) == self.rank:
            total = int((lay.n + lay.d).sum())
            hidden = _recv([torch.empty(total, self.hidden, dtype=self.dtype, device=self.device)], 0)[0]
        self.drafter.run(reqs, lay.final, TargetRows(hidden, lay.first_row, lay.starts))

    def finish_step(self) -> None:
        pass


def _module_pool(cfg, config, dtype: torch.dtype, device: torch.device) -> LayerKV:
    return layer_pool(cfg, config.num_blocks, config.block_size, dtype, device)


def _no_pool(device: torch.device) -> LayerKV:
    return LayerKV(torch.empty(0, device=device), torch.empty(0, device=device))


def _pack_chain(chain: _Chain) -> list[torch.Tensor]:
    return [torch.cat((chain.tokens[..., None], chain.q_ids), dim=-1), chain.q_probs]


def _chain_buffers(rows: int, k: int, top_m: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(rows, k, 1 + top_m, dtype=torch.long, device=device),
            torch.empty(rows, k, top_m, dtype=torch.float32, device=device)]


def _pack_emitted(result: StepResult, width: int, device: torch.device) -> torch.Tensor:
    out = np.zeros((len(result.req_ids), width), dtype=np.int64)
    for i, (a, tokens) in enumerate(zip(result.num_accepted, result.token_ids)):
        out[i, 0] = a
        out[i, 1 : 1 + len(tokens)] = tokens
    return torch.from_numpy(out).to(device)
