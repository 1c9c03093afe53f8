"""The MTP chain of a uniform step at fixed shapes (docs/design.md §3 and §8).

Notation of one request: N verified tokens before the step (t_{N-1} newest), a drafts accepted, so
N' = N + a + 1 after it, and the drafting position is p = N' - 2.

Module m (a module pass of the chain) has committed positions [0, N - m - 1) before the step and
must compute N - m - 1 .. p: a + m + 1 positions. It runs `window + m` rows per request at positions
N - m - 1 + j, whatever a is:
  * token input t_{i+m+1} of row j is seq[j] = t_{N+j}: the emitted tokens for j <= a, then this
    step's new drafts (row a + m, the drafting row, reads new draft m - 1, sampled by module m - 1);
  * hidden input of row j: module m - 1's output at the same position, i.e. its row j - 1, and for
    row 0 the carried g^{m-1} of module m - 1's last committed position (m = 0: target row j);
  * rows past a + m compute garbage at positions > p; their KV is overwritten next step, which
    recomputes from N' - m - 1 <= p, before anything reads it (or dropped, past the owned blocks).
After the pass, row a holds g^m at N' - m - 2, module m's new last committed position: the carry.
Recursive steps (EAGLE style, or past the last module) run one row at p + offset from the previous
step's output. Every request with num_spec <= j ignores chain step j (its KV writes are dropped).
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.workers.attention import LayerKV
from mtpserve.workers.chain import chain_steps
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.sampling import SamplingTensors, apply_penalties, argmax_rows, sample_draft
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, chain_rows, pass_rows, window_rows
from mtpserve.workers.state import SlotBuffers


# A draft position's top-M proposal ids and probabilities [B, M], or (None, None) for a greedy batch.
Proposal = tuple[torch.Tensor, torch.Tensor] | tuple[None, None]


class UniformChain:
    def __init__(self, mtp: MTPStack, embed: nn.Embedding, head: nn.Linear, kv: list[LayerKV],
                 buffers: SlotBuffers, state: DeviceState, mode: str, top_m: int, num_modules: int) -> None:
        self.mtp, self.embed, self.head, self.kv = mtp, embed, head, kv
        self.buffers, self.state, self.mode, self.top_m, self.num_modules = buffers, state, mode, top_m, num_modules

    def __call__(self, slots: torch.Tensor, seq_len: torch.Tensor, frontier: torch.Tensor, accepted: torch.Tensor,
                 emitted: torch.Tensor, target_rows: torch.Tensor, shape, samp: SamplingTensors) -> None:
        """emitted [B, w] (valid up to index a), target_rows [B, w, H]: hidden for module 0; frontier [B]: the
        verified tokens after the step (N + a + 1).

        Kernels are counted here: on small models a module pass is mostly launches, so the glue between
        passes is built once per step (one kernel lays out every window pass: positions, KV slots, block
        tables, the rows to read back; the token rows are written in place as drafts come; the carries
        are read and written once)."""
        batch, w, k = len(slots), shape.window, shape.chain
        steps = chain_steps(k, self.num_modules, self.mode)
        lay = chain_rows(self.state, slots, seq_len, accepted, emitted, sum(step.offset == 0 for step in steps))
        tokens = lay.tokens.view(-1)  # row j of request b holds t_{N+j}; drafts land at lay.draft_at
        sampler = DraftSampler(self, slots, frontier, samp, shape.flags)
        old_carry = self.buffers.carry[slots]  # [B, modules, H]
        recursive = any(step.offset for step in steps)
        spec = self.state.num_spec[slots] if recursive else None  # [B]: each request's chain length
        drafts, proposals, carry, prev, last = [], [], [], target_rows, None
        for j, step in enumerate(steps):
            m = step.module
            if step.offset == 0:
                q = w + m
                meta, pos = pass_rows(self.state, lay, m)
                # Hidden row j is module m - 1's row j - 1, and row 0 its carry (module 0: target row j).
                g = self.mtp(m, lay.tokens[:, :q], prev, pos, meta, self.kv[m], self.embed,
                             first_hidden=None if m == 0 else old_carry[:, m - 1]).view(batch, q, -1)
                prev = self.mtp.next_hidden(m, g)
                g, kept, last = _read_back(g, prev, lay.rows[m], recursive)
                carry.append(kept)
            else:
                reach = (spec > j).long()  # rows past a request's own chain write nothing
                meta, pos = window_rows(self.state, 1 + m, slots, frontier - 2 + step.offset, 1, reach)
                g = self.mtp(m, drafts[j - 1], last, pos, meta, self.kv[m], self.embed)
                last = self.mtp.next_hidden(m, g)
            token, ids, probs = sampler(j, self.mtp.logits(m, g, self.head, fp32=sampler.needs_fp32))
            drafts.append(token)
            proposals.append((ids, probs))
            if j + 1 < len(steps) and steps[j + 1].offset == 0:  # the next module pass reads this draft
                tokens.scatter_(0, lay.draft_at[j], token)
        self.store(slots, torch.stack(drafts, 1), proposals, carry, lay.used, old_carry)

    def store(self, slots: torch.Tensor, drafts: torch.Tensor, proposals: list[Proposal], carry: list[torch.Tensor],
              used: torch.Tensor | None, old_carry: torch.Tensor) -> None:
        """Write drafts, proposals (absent when every row is greedy: greedy verification never reads them)
        and carries into the slots after the chain. carry lists modules 0, 1, ... in order, each its g^m row
        [B, H]; used [>= len(carry), B]: whether the request's chain reached the module; old_carry
        [B, modules, H] is what they held before the step."""
        b, k = self.buffers, drafts.shape[1]
        b.draft_tokens[slots, :k] = drafts
        if proposals and proposals[0][0] is not None:
            b.q_ids[slots, :k] = torch.stack([ids for ids, _ in proposals], 1)
            b.q_probs[slots, :k] = torch.stack([probs for _, probs in proposals], 1)
        if carry:
            n = len(carry)
            b.carry[slots, :n] = torch.where(used[:n].T[..., None], torch.stack(carry, 1), old_carry[:, :n])


def _read_back(g: torch.Tensor, prev: torch.Tensor, rows: torch.Tensor, recursive: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """After a window pass (g, prev [B, q, H]; rows [2, B]: flat drafting and carry rows) -> (g at the drafting
    row, prev at the carry row, prev at the drafting row when recursive steps follow), in as few gathers as
    the module allows: one when it hands g on unchanged."""
    batch = rows.shape[1]
    if prev is g:
        both = g.reshape(batch * g.shape[1], -1).index_select(0, rows.view(-1))  # [2B, H]
        return both[:batch], both[batch:], both[:batch]
    flat, hidden = prev.reshape(-1, prev.shape[-1]), g.reshape(-1, g.shape[-1])
    last = flat.index_select(0, rows[0]) if recursive else None
    return hidden.index_select(0, rows[0]), flat.index_select(0, rows[1]), last


class DraftSampler:
    """Samples draft j of every row with the request's own transform (penalties see earlier drafts)."""

    def __init__(self, chain: UniformChain, slots: torch.Tensor, frontier: torch.Tensor, samp: SamplingTensors,
                 flags: SamplingFlags) -> None:
        self.chain, self.slots, self.frontier, self.samp, self.flags = chain, slots, frontier, samp, flags
        self.extra = None
        if flags.penalties:
            self.extra = torch.zeros(len(slots), chain.state.vocab, device=slots.device)
        # A plain greedy draft is the argmax of the head's own output: upcasting it first changes no value.
        self.needs_fp32 = not flags.all_greedy or flags.penalties

    def __call__(self, j: int, logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, None, None]:
        """logits [B, V] -> (draft [B], top-M ids [B, M], top-M probs [B, M]); greedy: (draft [B], None, None)."""
        m = self.chain.top_m
        st = self.samp
        if self.extra is not None:
            counts, prompt_mask = self.chain.buffers.penalty_state(self.slots)
            logits = apply_penalties(logits, counts + self.extra, prompt_mask, st)
        if self.flags.all_greedy:  # greedy verification never reads the proposals
            argmax = argmax_rows(logits)
            if self.extra is not None:
                self.extra[torch.arange(len(argmax), device=argmax.device), argmax] += 1.0
            return argmax, None, None
        tokens, ids, probs = sample_draft(logits, st, m, self.frontier + j)
        if self.extra is not None:
            self.extra[torch.arange(len(tokens), device=tokens.device), tokens] += 1.0
        return tokens, _pad_m(ids, m), _pad_m(probs, m)


def _pad_m(x: torch.Tensor, m: int) -> torch.Tensor:
    """Small vocabularies give fewer than m entries: pad with zero-probability copies of entry 0."""
    if x.shape[1] == m:
        return x
    pad = x[:, :1].expand(-1, m - x.shape[1])
    return torch.cat((x, torch.zeros_like(pad) if x.is_floating_point() else pad), dim=1)
