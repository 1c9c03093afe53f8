"""The MTP drafter chain (DESIGN.md §3), run right after the target verified a step.

Module m at position i consumes t_{i+m+1} and g^{m-1}_i (g^{-1} = target hidden). It keeps a KV
entry only where those inputs are verified: after a step with N' verified tokens it has committed
positions [0, N'-m-1). Each step it recomputes from its last committed position up to the drafting
position p = N'-2; entries there that used drafts are overwritten next step. Module m+1 needs g^m at
one position module m committed in an earlier step: that row is kept in the slot's `carry`.
Prefill chunks run the same code, so the first drafts come out of the prefill step itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mtpserve.workers.attention import LayerKV
from mtpserve.workers.batch import build_metadata
from mtpserve.workers.chain import chain_steps
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.sampling import STREAM_DRAFT, apply_penalties, sample, to_probs, top_m, uniforms
from mtpserve.workers.state import CachedRequest, SlotBuffers, sampling_tensors


@dataclass
class TargetRows:
    """Where each scheduled request's target hidden states sit in this step's flat batch."""

    hidden: torch.Tensor  # [T, H] hidden states to hand to module 0 (pre- or post-norm per checkpoint)
    first_row: np.ndarray  # [R] row of each request's first query
    first_pos: np.ndarray  # [R] position of that row


@dataclass
class _PassOutput:
    """One module's output over a pass: rows per request index, addressed by position."""

    nh: torch.Tensor  # [rows, H] hidden handed onwards (next_hidden of g)
    first_row: dict[int, int]
    first_pos: dict[int, int]


class Drafter:
    def __init__(self, mtp: MTPStack, embed: nn.Embedding, head: nn.Linear, kv: list[LayerKV],
                 slots: SlotBuffers, block_size: int, mode: str, top_m: int, vocab: int) -> None:
        self.mtp, self.embed, self.head, self.kv = mtp, embed, head, kv
        self.slots, self.block_size, self.mode, self.top_m, self.vocab = slots, block_size, mode, top_m, vocab
        self.device = slots.device

    def run(self, reqs: list[CachedRequest], final: list[bool], rows: TargetRows) -> None:
        """Advance every module's KV for the scheduled requests and draft for those that sampled."""
        max_spec = max((r.num_spec for r in reqs), default=0)
        if max_spec == 0 or len(self.mtp) == 0:
            return
        drafting = [i for i, r in enumerate(reqs) if final[i] and r.num_spec > 0]
        chain = _Chain(self, reqs, drafting)
        old_commit = [list(r.mtp_computed) for r in reqs]
        prev: _PassOutput | None = None
        for j, step in enumerate(chain_steps(max_spec, len(self.mtp), self.mode)):
            if step.offset == 0:
                prev = self._module_pass(step.module, j, reqs, final, rows, prev, old_commit, chain)
            else:
                self._recursive_pass(step.module, step.offset, j, reqs, chain)

    def _module_pass(self, m: int, j: int, reqs: list[CachedRequest], final: list[bool], rows: TargetRows,
                     prev: _PassOutput | None, old_commit: list[list[int]], chain: "_Chain") -> _PassOutput:
        idx, starts, ends, commits = [], [], [], []
        for i, r in enumerate(reqs):
            if r.num_spec <= m:  # the chain of this request never reaches module m
                continue
            n_verified = len(r.token_ids)
            end = n_verified - 1 if final[i] else min(r.num_computed, n_verified - m - 1)
            if end > r.mtp_computed[m]:
                idx.append(i), starts.append(r.mtp_computed[m]), ends.append(end)
                commits.append(max(0, min(r.num_computed, n_verified - m - 1)))
        out = _PassOutput(torch.empty(0), {}, {})
        if not idx:
            return out
        starts_a, lens = np.array(starts), np.array(ends) - np.array(starts)
        token_ids = self._module_tokens(m, reqs, idx, starts_a, lens, chain)
        hidden = self._module_hidden(m, reqs, idx, starts_a, lens, rows, prev, old_commit)
        tables = [reqs[i].block_ids[1 + m] for i in idx]
        positions, meta = build_metadata(starts_a, lens, tables, self.block_size, self.device)
        g = self.mtp(m, token_ids, hidden, positions, meta, self.kv[m], self.embed)
        nh = self.mtp.next_hidden(m, g)
        first_rows = np.concatenate(([0], np.cumsum(lens)[:-1]))
        self._commit(m, reqs, idx, starts_a, first_rows, commits, nh)
        out = _PassOutput(nh, dict(zip(idx, first_rows.tolist())), dict(zip(idx, starts)))
        last_rows = first_rows + lens - 1
        drafters = [k for k, i in enumerate(idx) if final[i] and reqs[i].num_spec > j]
        if drafters:
            sel = torch.tensor(last_rows[drafters], device=self.device)
            chain.draft(j, [idx[k] for k in drafters], self.mtp.logits(m, g[sel], self.head), nh[sel])
        return out

    def _recursive_pass(self, m: int, offset: int, j: int, reqs: list[CachedRequest], chain: "_Chain") -> None:
        idx = [i for i in chain.drafting if reqs[i].num_spec > j]
        starts = np.array([len(reqs[i].token_ids) - 2 + offset for i in idx])
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
        ids = torch.tensor(host, dtype=torch.long, device=self.device)
        if flat:
            ids[torch.tensor(flat, device=self.device)] = chain.tokens[rows, cols]
        return ids

    def _module_hidden(self, m: int, reqs: list[CachedRequest], idx: list[int], starts: np.ndarray, lens: np.ndarray,
                       rows: TargetRows, prev: _PassOutput | None, old_commit: list[list[int]]) -> torch.Tensor:
        """g^{m-1}_i for every position of the pass (g^{-1} = target hidden)."""
        req_rep = np.repeat(np.arange(len(idx)), lens)
        pos = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens) + starts[req_rep]
        idx_a = np.array(idx)[req_rep]
        if m == 0:
            src_rows = rows.first_row[idx_a] + pos - rows.first_pos[idx_a]
            return rows.hidden[torch.from_numpy(src_rows).to(self.device)]
        # Positions below module m-1's old commit were computed in an earlier step: only the carried row.
        carried = pos < np.array([old_commit[i][m - 1] for i in idx_a])
        first_row = np.array([prev.first_row.get(i, 0) for i in idx_a])
        first_pos = np.array([prev.first_pos.get(i, 0) for i in idx_a])
        src_rows = np.where(carried, 0, first_row + pos - first_pos)
        hidden = prev.nh[torch.from_numpy(src_rows).to(self.device)] if prev.nh.numel() else \
            self.slots.carry.new_empty(len(pos), self.slots.carry.shape[-1])
        if carried.any():
            slots = torch.tensor([reqs[i].slot for i in idx_a[carried]], device=self.device)
            hidden[torch.from_numpy(np.flatnonzero(carried)).to(self.device)] = self.slots.carry[slots, m - 1]
        return hidden

    def _commit(self, m: int, reqs: list[CachedRequest], idx: list[int], starts: np.ndarray,
                first_rows: np.ndarray, commits: list[int], nh: torch.Tensor) -> None:
        """Record module m's committed positions and carry g^m at its last committed one."""
        moved = [k for k, i in enumerate(idx) if commits[k] > reqs[i].mtp_computed[m]]
        if moved:
            src = [int(first_rows[k] + commits[k] - 1 - starts[k]) for k in moved]
            slots = torch.tensor([reqs[idx[k]].slot for k in moved], device=self.device)
            self.slots.carry[slots, m] = nh[torch.tensor(src, device=self.device)]
        for k, i in enumerate(idx):
            reqs[i].mtp_computed[m] = max(reqs[i].mtp_computed[m], commits[k])


class _Chain:
    """This step's drafts for the requests that sampled, and their sampling."""

    def __init__(self, drafter: Drafter, reqs: list[CachedRequest], drafting: list[int]) -> None:
        self.d, self.reqs, self.drafting = drafter, reqs, drafting
        self.row = {i: f for f, i in enumerate(drafting)}
        dev = drafter.device
        k = max((reqs[i].num_spec for i in drafting), default=1)
        self.tokens = torch.zeros(len(drafting), k, dtype=torch.long, device=dev)
        self.last_hidden = drafter.slots.carry.new_zeros(len(drafting), drafter.slots.carry.shape[-1])
        chosen = [reqs[i] for i in drafting]
        self.st = sampling_tensors(chosen, drafter.vocab, dev) if chosen else None
        self.frontier = torch.tensor([len(r.token_ids) for r in chosen], dtype=torch.long, device=dev)
        self.slot_ids = torch.tensor([r.slot for r in chosen], dtype=torch.long, device=dev)
        self.extra_counts = None
        if self.st is not None and self.st.use_penalties:
            self.extra_counts = torch.zeros(len(drafting), drafter.vocab, device=dev)

    def rows_of(self, idx: list[int]) -> torch.Tensor:
        return torch.tensor([self.row[i] for i in idx], dtype=torch.long, device=self.d.device)

    def draft(self, j: int, idx: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Sample draft j (the token at frontier + j) for requests idx from their module logits [n, V]."""
        f = self.rows_of(idx)
        st = self.st.take(f)
        slots = self.slot_ids[f]
        if self.extra_counts is not None:
            counts, prompt_mask = self.d.slots.penalty_state(slots)
            logits = apply_penalties(logits, counts + self.extra_counts[f], prompt_mask, st)
        probs = to_probs(logits, st)
        q_ids, q_probs = top_m(probs, self.d.top_m)
        u = uniforms(st.seed, self.frontier[f] + j, STREAM_DRAFT)
        sampled = q_ids.gather(1, sample(q_probs, u)[:, None]).squeeze(1)
        tokens = torch.where(st.greedy, logits.argmax(-1), sampled)
        self.tokens[f, j] = tokens
        self.last_hidden[f] = hidden
        self.d.slots.draft_tokens[slots, j] = tokens
        self.d.slots.q_ids[slots, j] = _pad_m(q_ids, self.d.top_m)
        self.d.slots.q_probs[slots, j] = _pad_m(q_probs, self.d.top_m)
        if self.extra_counts is not None:
            self.extra_counts[f, tokens] += 1.0


def _pad_m(x: torch.Tensor, m: int) -> torch.Tensor:
    """Small vocabularies give fewer than m entries: pad with zero-probability copies of entry 0."""
    if x.shape[1] == m:
        return x
    pad = x[:, :1].expand(-1, m - x.shape[1])
    return torch.cat((x, torch.zeros_like(pad) if x.is_floating_point() else pad), dim=1)
