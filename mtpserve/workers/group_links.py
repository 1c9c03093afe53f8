"""How a drafter group (docs/design.md §2) moves tensors: where each module lives, and the links that hand
the MTP chain on between its ranks, for the general path's Drafter and for the uniform step's chain.

Every rank applies the same StepPlans, so each knows every tensor's shape without being told: only
tensors travel, point to point (NCCL on a GPU, gloo on the CPU, outside any CUDA graph), with no headers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtpserve.workers.chain import chain_steps
from mtpserve.workers.drafter import _Chain
from mtpserve.workers.state import CachedRequest
from mtpserve.workers.uniform_chain import ChainRun


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


# MTPSERVE_TRACE_P2P=1: every rank prints each point-to-point op (peer, shape, dtype) to stderr. Every rank
# derives the same shapes from the same plans; when a group hangs, the first op whose two sides disagree is
# the one to look at (NCCL matches a send with a recv by order alone, whatever their sizes).
_TRACE = os.environ.get("MTPSERVE_TRACE_P2P", "") not in ("", "0")


def _trace(op: str, t: torch.Tensor, peer: int) -> None:
    print(f"[p2p] rank {dist.get_rank()} {op} {'to' if op == 'send' else 'from'} {peer}: "
          f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}", file=sys.stderr, flush=True)


def send(tensors: list[torch.Tensor], dst: int) -> None:
    for t in tensors:
        if t.numel():
            if _TRACE:
                _trace("send", t, dst)
            dist.send(t.contiguous(), dst)


def recv(tensors: list[torch.Tensor], src: int) -> list[torch.Tensor]:
    for t in tensors:
        if t.numel():
            if _TRACE:
                _trace("recv", t, src)
            dist.recv(t, src)
    return tensors


def draft_payload(drafts: torch.Tensor, q_ids: torch.Tensor | None, q_probs: torch.Tensor | None
                  ) -> list[torch.Tensor]:
    """Drafts [R, k] with their proposals [R, k, M] as sent: [drafts], or ids [R, k, 1 + M] (the draft first)
    and probabilities; a greedy batch sends no proposals."""
    if q_ids is None:
        return [drafts]
    return [torch.cat((drafts[..., None], q_ids), dim=-1), q_probs]


def draft_buffers(rows: int, k: int, top_m: int, greedy: bool, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers of a draft_payload."""
    if greedy:
        return [torch.empty(rows, k, dtype=torch.long, device=device)]
    return [torch.empty(rows, k, 1 + top_m, dtype=torch.long, device=device),
            torch.empty(rows, k, top_m, dtype=torch.float32, device=device)]


def unpack_drafts(payload: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A received draft_payload -> (drafts [R, k], proposal ids [R, k, M] and probabilities, or None, None)."""
    if len(payload) == 1:
        return payload[0], None, None
    ids, probs = payload
    return ids[..., 0], ids[..., 1:], probs


class GroupChainLink:
    """The general path's Drafter in the group: which modules are here, and how its chain moves between ranks."""

    def __init__(self, topo: Topology, rank: int, hidden: int, dtype: torch.dtype, top_m: int,
                 device: torch.device) -> None:
        self.topo, self.rank, self.hidden, self.dtype = topo, rank, hidden, dtype
        self.top_m, self.device = top_m, device

    def owns(self, module: int) -> bool:
        return self.topo.owner(module) == self.rank

    def hand_over(self, to_module: int, nh: torch.Tensor, chain: _Chain) -> None:
        send([nh, *draft_payload(chain.tokens, chain.q_ids, chain.q_probs)], self.topo.owner(to_module))

    def take_over(self, from_module: int, rows: int, chain: _Chain, j: int) -> torch.Tensor:
        nh = torch.empty(rows, self.hidden, dtype=self.dtype, device=self.device)
        bufs = draft_buffers(len(chain.drafting), chain.tokens.shape[1], self.top_m, False, self.device)
        recv([nh, *bufs], self.topo.owner(from_module))
        if chain.drafting:
            chain.adopt(*unpack_drafts(bufs), j)
        return nh

    def deliver(self, last_module: int, chain: _Chain) -> None:
        if chain.drafting:
            payload = draft_payload(chain.tokens, chain.q_ids, chain.q_probs)
            for target_rank in range(self.topo.tp):
                send(payload, target_rank)


class UniformGroupLink:
    """The uniform chain's hand-overs (mtpserve/workers/uniform_chain.py) between drafter ranks: module m + 1's
    owner reads module m's output rows, and the drafts (and proposals) so far. The drafts of the last step go to
    the target ranks after the step (drafter_steps.KeptDelivery, which wraps this link)."""

    def __init__(self, topo: Topology, rank: int, top_m: int) -> None:
        self.topo, self.rank, self.top_m = topo, rank, top_m

    def owns(self, module: int) -> bool:
        return self.topo.owner(module) == self.rank

    def take_over(self, run: ChainRun, j: int) -> None:
        # Only a module pass changes hands: a recursive step stays with the module of the step before it.
        module = run.steps[j - 1].module
        batch, q = len(run.slots), run.window + module
        rows = run.old_carry.new_empty(batch, q, run.old_carry.shape[-1])
        payload = draft_buffers(batch, j, self.top_m, run.greedy, run.slots.device)
        recv([rows, *payload], self.topo.owner(module))
        run.adopt(module, rows, *unpack_drafts(payload))

    def hand_over(self, run: ChainRun, j: int) -> None:
        send([run.prev, *draft_payload(*run.stacked())], self.topo.owner(run.steps[j + 1].module))
