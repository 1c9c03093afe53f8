"""The MTP drafter chain (docs/design.md §3), run right after the target verified a step.

Module m at position i consumes t_{i+m+1} and g^{m-1}_i (g^{-1} = target hidden). It keeps a KV
entry only where those inputs are verified: after a step with N' verified tokens it has committed
positions [0, N'-m-1). Each step it recomputes from its last committed position up to the drafting
position p = N'-2; entries there that used drafts are overwritten next step. Module m+1 needs g^m at
one position module m committed in an earlier step: that row is kept in the slot's `carry`.
Prefill chunks run the same code, so the first drafts come out of the prefill step itself.

The modules may live on several devices (the drafter group, docs/design.md §2): then every process runs
this same loop over the same per-request state, computes only the passes of the modules it owns
(`link.owns`), keeps the host bookkeeping of all of them, and hands the chain on through the link
(mtpserve/workers/group_links.py). This is the general path's chain; uniform steps run the device-resident
one (mtpserve/workers/uniform_chain.py), in a group too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from mtpserve.workers.attention import LayerKV
from mtpserve.workers.batch import build_metadata
from mtpserve.workers.chain import ChainStep, chain_steps
from mtpserve.workers.device import to_device
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.sampling import apply_penalties, sample_draft
from mtpserve.workers.state import CachedRequest, SlotBuffers, sampling_tensors


@dataclass
class TargetRows:
    """Where each scheduled request's target hidden states sit in this step's flat batch."""

    hidden: torch.Tensor | None  # [T, H] hidden states for module 0 (pre- or post-norm); None where not needed
    first_row: np.ndarray  # [R] row of each request's first query
    first_pos: np.ndarray  # [R] position of that row


@dataclass
class ModulePlan:
    """Host-side layout of one module pass: identical on every process that tracks the requests."""

    module: int
    idx: list[int]  # request indices in the pass
    starts: np.ndarray  # [n] first position per request
    lens: np.ndarray  # [n] positions per request
    commits: list[int]  # committed positions after the pass
    moved: list[int]  # entries k of idx whose commit advances (their carry row changes)
    drafters: list[int]  # entries k of idx that draft at this chain step

    @property
    def first_rows(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.lens)[:-1])).astype(np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.lens.sum())


@dataclass
class _PassOutput:
    """One module's output over a pass: rows per request index, addressed by position."""

    nh: torch.Tensor  # [rows, H] hidden handed onwards (next_hidden of g)
    first_row: dict[int, int]
    first_pos: dict[int, int]


class ChainLink(Protocol):
    """Moves the chain between the devices of the drafter group (absent when every module is local)."""

    def owns(self, module: int) -> bool: ...

    def hand_over(self, to_module: int, nh: torch.Tensor, chain: "_Chain") -> None: ...

    def take_over(self, from_module: int, rows: int, chain: "_Chain", j: int) -> torch.Tensor: ...

    def deliver(self, last_module: int, chain: "_Chain") -> None: ...


class Drafter:
    def __init__(self, mtp: MTPStack, embed: nn.Embedding, head: nn.Linear, kv: list[LayerKV],
                 slots: SlotBuffers, block_size: int, mode: str, top_m: int, vocab: int,
                 link: ChainLink | None = None) -> None:
        self.mtp, self.embed, self.head, self.kv = mtp, embed, head, kv
        self.slots, self.block_size, self.mode, self.top_m, self.vocab = slots, block_size, mode, top_m, vocab
        self.device = slots.device
        self.link = link

    def _here(self, module: int) -> bool:
        return self.link is None or self.link.owns(module)

    def run(self, reqs: list[CachedRequest], final: list[bool], rows: TargetRows) -> None:
        """Advance every module's KV for the scheduled requests and draft for those that sampled."""
        max_spec = max((r.num_spec for r in reqs), default=0)
        if max_spec == 0 or len(self.mtp) == 0:
            return
        drafting = [i for i, r in enumerate(reqs) if final[i] and r.num_spec > 0]
        chain = _Chain(self, reqs, drafting)
        old_commit = [list(r.mtp_computed) for r in reqs]
        steps = chain_steps(max_spec, len(self.mtp), self.mode)
        prev: _PassOutput | None = None
        prev_plan: ModulePlan | None = None
        # Carry rows are written only after the loop: module m+1 must read the row module m committed in
        # an earlier step, not the one module m commits in this step.
        carry: list[tuple[ModulePlan, torch.Tensor]] = []
        for j, step in enumerate(steps):
            m = step.module
            if step.offset > 0:
                if self._here(m):
                    self._recursive_pass(m, step.offset, j, reqs, chain)
                continue
            plan = self._plan(m, j, reqs, final)
            if self._here(m) and prev_plan is not None and not self._here(prev_plan.module):
                prev.nh = self.link.take_over(prev_plan.module, prev_plan.num_rows, chain, j)
                carry.append((prev_plan, prev.nh))
            nh = self._module_pass(plan, j, reqs, rows, prev, old_commit, chain) if self._here(m) else None
            if nh is not None:
                carry.append((plan, nh))
                if _next_module(steps, j) not in (None, m) and not self._here(_next_module(steps, j)):
                    self.link.hand_over(_next_module(steps, j), nh, chain)
            for k, i in enumerate(plan.idx):
                reqs[i].mtp_computed[m] = max(reqs[i].mtp_computed[m], plan.commits[k])
            prev, prev_plan = self._output(plan, nh), plan
        for plan, nh in carry:
            self._write_carry(plan, reqs, nh)
        if self.link is not None and self._here(steps[-1].module):
            self.link.deliver(steps[-1].module, chain)

    def _plan(self, m: int, j: int, reqs: list[CachedRequest], final: list[bool]) -> ModulePlan:
        idx, starts, ends, commits = [], [], [], []
        for i, r in enumerate(reqs):
            if r.num_spec <= m:  # the chain of this request never reaches module m
                continue
            n_verified = len(r.token_ids)
            end = n_verified - 1 if final[i] else min(r.num_computed, n_verified - m - 1)
            if end > r.mtp_computed[m]:
                idx.append(i), starts.append(r.mtp_computed[m]), ends.append(end)
                commits.append(max(0, min(r.num_computed, n_verified - m - 1)))
        starts_a = np.array(starts, dtype=np.int64)
        moved = [k for k, i in enumerate(idx) if commits[k] > reqs[i].mtp_computed[m]]
        drafters = [k for k, i in enumerate(idx) if final[i] and reqs[i].num_spec > j]
        return ModulePlan(m, idx, starts_a, np.array(ends, dtype=np.int64) - starts_a, commits, moved, drafters)

    def _output(self, plan: ModulePlan, nh: torch.Tensor | None) -> _PassOutput:
        if nh is None:
            nh = torch.empty(0, device=self.device)  # computed elsewhere: filled in if this process needs it
        return _PassOutput(nh, dict(zip(plan.idx, plan.first_rows.tolist())), dict(zip(plan.idx, plan.starts.tolist())))

    def _module_pass(self, plan: ModulePlan, j: int, reqs: list[CachedRequest], rows: TargetRows,
                     prev: _PassOutput | None, old_commit: list[list[int]], chain: "_Chain") -> torch.Tensor:
        m, idx = plan.module, plan.idx
        if not idx:
            return self.slots.carry.new_empty(0, self.slots.carry.shape[-1])
        token_ids = self._module_tokens(m, reqs, idx, plan.starts, plan.lens, chain)
        hidden = self._module_hidden(m, reqs, idx, plan.starts, plan.lens, rows, prev, old_commit)
        tables = [reqs[i].block_ids[1 + m] for i in idx]
        positions, meta = build_metadata(plan.starts, plan.lens, tables, self.block_size, self.device)
        g = self.mtp(m, token_ids, hidden, positions, meta, self.kv[m], self.embed)
        nh = self.mtp.next_hidden(m, g)
        if plan.drafters:
            last_rows = plan.first_rows + plan.lens - 1
            sel = to_device(last_rows[plan.drafters], torch.long, self.device)
            chain.draft(j, [idx[k] for k in plan.drafters], self.mtp.logits(m, g[sel], self.head), nh[sel])
        return nh

    def _recursive_pass(self, m: int, offset: int, j: int, reqs: list[CachedRequest], chain: "_Chain") -> None:
        idx = [i for i in chain.drafting if reqs[i].num_spec > j]
        if not idx:  # nobody in this step drafts this far (e.g. only prefill chunks that do not finish)
            return
        starts = np.array([len(reqs[i].token_ids) - 2 + offset for i in idx], dtype=np.int64)
        tables = [reqs[i].block_ids[1 + m] for i in idx]
        positions, meta = build_metadata(starts, np.ones(len(idx), dtype=np.int64), tables, self.block_size, self.device)
        f = chain.rows_of(idx)
        g = self.mtp(m, chain.tokens[f, j - 1], chain.last_hidden[f], positions, meta, self.kv[m], self.embed)
        chain.draft(j, idx, self.mtp.logits(m, g, self.head), self.mtp.next_hidden(m, g))

    def _module_tokens(self, m: int, reqs: list[CachedRequest], idx: list[int], starts: np.ndarray,
                       lens: np.ndarray, chain: "_Chain") -> torch.Tensor:
        """t_{i+m+1} for every position i of the pass: verified tokens, then this step's drafts."""
        host: list[int] = []
        flat, rows, cols = [], [], []
        for i, s, n in zip(idx, starts.tolist(), lens.tolist()):
            verified = reqs[i].token_ids[s + m + 1 : s + m + 1 + n]
            num_drafted = n - len(verified)
            flat += range(len(host) + len(verified), len(host) + n)
            rows += [chain.row.get(i, 0)] * num_drafted
            cols += range(num_drafted)
            host += verified + [0] * num_drafted
        ids = to_device(host, torch.long, self.device)
        if flat:
            ids[to_device(flat, torch.long, self.device)] = chain.tokens[rows, cols]
        return ids

    def _module_hidden(self, m: int, reqs: list[CachedRequest], idx: list[int], starts: np.ndarray, lens: np.ndarray,
                       rows: TargetRows, prev: _PassOutput | None, old_commit: list[list[int]]) -> torch.Tensor:
        """g^{m-1}_i for every position of the pass (g^{-1} = target hidden)."""
        req_rep = np.repeat(np.arange(len(idx)), lens)
        pos = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens) + starts[req_rep]
        idx_a = np.array(idx)[req_rep]
        if m == 0:
            src_rows = rows.first_row[idx_a] + pos - rows.first_pos[idx_a]
            return rows.hidden[to_device(src_rows, torch.long, self.device)]
        # Positions below module m-1's old commit were computed in an earlier step: only the carried row.
        carried = pos < np.array([old_commit[i][m - 1] for i in idx_a])
        first_row = np.array([prev.first_row.get(i, 0) for i in idx_a])
        first_pos = np.array([prev.first_pos.get(i, 0) for i in idx_a])
        src_rows = np.where(carried, 0, first_row + pos - first_pos)
        hidden = prev.nh[to_device(src_rows, torch.long, self.device)] if prev.nh.numel() else \
            self.slots.carry.new_empty(len(pos), self.slots.carry.shape[-1])
        if carried.any():
            slots = to_device([reqs[i].slot for i in idx_a[carried]], torch.long, self.device)
            hidden[to_device(np.flatnonzero(carried), torch.long, self.device)] = self.slots.carry[slots, m - 1]
        return hidden

    def _write_carry(self, plan: ModulePlan, reqs: list[CachedRequest], nh: torch.Tensor) -> None:
        """Carry g^m at module m's last committed position, for module m+1's next step."""
        if plan.moved:
            first_rows = plan.first_rows
            src = [int(first_rows[k] + plan.commits[k] - 1 - plan.starts[k]) for k in plan.moved]
            slots = to_device([reqs[plan.idx[k]].slot for k in plan.moved], torch.long, self.device)
            self.slots.carry[slots, plan.module] = nh[to_device(src, torch.long, self.device)]


def _next_module(steps: list[ChainStep], j: int) -> int | None:
    """The module of the next module pass after step j (None when no module pass follows)."""
    nxt = steps[j + 1] if j + 1 < len(steps) else None
    return nxt.module if nxt is not None and nxt.offset == 0 else None


class _Chain:
    """This step's drafts for the requests that sampled, and their sampling."""

    def __init__(self, drafter: Drafter, reqs: list[CachedRequest], drafting: list[int]) -> None:
        self.d, self.reqs, self.drafting = drafter, reqs, drafting
        self.row = {i: f for f, i in enumerate(drafting)}
        dev = drafter.device
        k = max((reqs[i].num_spec for i in drafting), default=1)
        self.tokens = torch.zeros(len(drafting), k, dtype=torch.long, device=dev)
        # The proposals as sent to the verifier (also kept in the slots, where a local verifier reads them).
        self.q_ids = torch.zeros(len(drafting), k, drafter.top_m, dtype=torch.long, device=dev)
        self.q_probs = torch.zeros(len(drafting), k, drafter.top_m, dtype=torch.float32, device=dev)
        self.last_hidden = drafter.slots.carry.new_zeros(len(drafting), drafter.slots.carry.shape[-1])
        chosen = [reqs[i] for i in drafting]
        self.st = sampling_tensors(chosen, drafter.vocab, dev) if chosen else None
        self.frontier = to_device([len(r.token_ids) for r in chosen], torch.long, dev)
        self.slot_ids = to_device([r.slot for r in chosen], torch.long, dev)
        self.extra_counts = None
        if self.st is not None and self.st.use_penalties:
            self.extra_counts = torch.zeros(len(drafting), drafter.vocab, device=dev)

    def rows_of(self, idx: list[int]) -> torch.Tensor:
        return to_device([self.row[i] for i in idx], torch.long, self.d.device)

    def draft(self, j: int, idx: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Sample draft j (the token at frontier + j) for requests idx from their module logits [n, V]."""
        f = self.rows_of(idx)
        st = self.st.take(f)
        slots = self.slot_ids[f]
        if self.extra_counts is not None:
            counts, prompt_mask = self.d.slots.penalty_state(slots)
            logits = apply_penalties(logits, counts + self.extra_counts[f], prompt_mask, st)
        tokens, q_ids, q_probs = sample_draft(logits, st, self.d.top_m, self.frontier[f] + j)
        self.tokens[f, j] = tokens
        self.last_hidden[f] = hidden
        self.q_ids[f, j] = _pad_m(q_ids, self.d.top_m)
        self.q_probs[f, j] = _pad_m(q_probs, self.d.top_m)
        self.d.slots.draft_tokens[slots, j] = tokens
        self.d.slots.q_ids[slots, j] = self.q_ids[f, j]
        self.d.slots.q_probs[slots, j] = self.q_probs[f, j]
        if self.extra_counts is not None:
            self.extra_counts[f, tokens] += 1.0

    def adopt(self, tokens: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, j: int) -> None:
        """Take over drafts 0..j-1 sampled on another device (penalty counts follow from the tokens)."""
        self.tokens.copy_(tokens), self.q_ids.copy_(q_ids), self.q_probs.copy_(q_probs)
        if self.extra_counts is not None and j > 0:
            self.extra_counts.zero_()
            self.extra_counts.scatter_add_(1, tokens[:, :j], torch.ones_like(tokens[:, :j], dtype=torch.float))


def _pad_m(x: torch.Tensor, m: int) -> torch.Tensor:
    """Small vocabularies give fewer than m entries: pad with zero-probability copies of entry 0."""
    if x.shape[1] == m:
        return x
    pad = x[:, :1].expand(-1, m - x.shape[1])
    return torch.cat((x, torch.zeros_like(pad) if x.is_floating_point() else pad), dim=1)
