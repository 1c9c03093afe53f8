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
from mtpserve.workers.sampling import STREAM_DRAFT, SamplingTensors, apply_penalties, sample, to_probs, top_m, uniforms
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, window_rows
from mtpserve.workers.state import SlotBuffers


# A draft position's top-M proposal ids and probabilities [B, M], or (None, None) for a greedy batch.
Proposal = tuple[torch.Tensor, torch.Tensor] | tuple[None, None]


class UniformChain:
    def __init__(self, mtp: MTPStack, embed: nn.Embedding, head: nn.Linear, kv: list[LayerKV],
                 buffers: SlotBuffers, state: DeviceState, mode: str, top_m: int, num_modules: int) -> None:
        self.mtp, self.embed, self.head, self.kv = mtp, embed, head, kv
        self.buffers, self.state, self.mode, self.top_m, self.num_modules = buffers, state, mode, top_m, num_modules

    def __call__(self, slots: torch.Tensor, seq_len: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor,
                 target_rows: torch.Tensor, shape, samp: SamplingTensors) -> None:
        """emitted [B, w] (valid up to index a), target_rows [B, w, H]: hidden for module 0.

        Kernels are counted here: on small models a module pass is mostly launches, so the glue between
        passes is built once per step (positions and KV slots in one kernel per pass, the token rows
        written in place as drafts come, the carries read and written once)."""
        batch, w, k = len(slots), shape.window, shape.chain
        steps = chain_steps(k, self.num_modules, self.mode)
        sampler = DraftSampler(self, slots, seq_len + accepted + 1, samp, shape.flags)
        js = torch.arange(k, device=slots.device)[:, None]  # [k, 1]: chain step j (window pass m = j)
        used = self.state.num_spec[slots] > js  # [k, B]: whether a request's chain runs step j
        limit = used * (w + js)  # [k, B]: rows step j may write (all q = w + m of a window pass; >= 1 past it)
        first = seq_len - 1 - js  # [k, B]: window pass m starts at N - m - 1
        at = accepted + js  # [k, B]: window pass m's drafting row, a + m
        seq = torch.cat((emitted, emitted.new_zeros(batch, k)), dim=1)  # [B, w + k]: row j holds t_{N+j}
        draft_at = (at + 1).T  # [B, k]: draft j's row in seq
        old_carry = self.buffers.carry[slots]  # [B, modules, H]
        rows = torch.arange(batch, device=slots.device)
        drafts, proposals, carry, prev, last = [], [], [], target_rows, None
        for j, step in enumerate(steps):
            m = step.module
            if step.offset == 0:
                q = w + m
                meta, pos = window_rows(self.state, 1 + m, slots, first[m], q, limit[j])
                # Hidden row j is module m - 1's row j - 1, and row 0 its carry (module 0: target row j).
                g = self.mtp(m, seq[:, :q], prev, pos, meta, self.kv[m], self.embed,
                             first_hidden=None if m == 0 else old_carry[:, m - 1]).view(batch, q, -1)
                prev = self.mtp.next_hidden(m, g)
                g_at = g[rows, at[m]]
                last = g_at if prev is g else prev[rows, at[m]]
                carry.append((m, last if m == 0 else prev[rows, accepted], used[j]))
                g = g_at
            else:
                meta, pos = window_rows(self.state, 1 + m, slots, seq_len + accepted - 1 + step.offset, 1, limit[j])
                g = self.mtp(m, drafts[j - 1], last, pos, meta, self.kv[m], self.embed)
                last = self.mtp.next_hidden(m, g)
            token, ids, probs = sampler(j, self.mtp.logits(m, g, self.head, fp32=sampler.needs_fp32))
            drafts.append(token)
            proposals.append((ids, probs))
            if j + 1 < len(steps) and steps[j + 1].offset == 0:  # the next module pass reads this draft
                seq.scatter_(1, draft_at[:, j : j + 1], token[:, None])
        self.store(slots, torch.stack(drafts, 1), proposals, carry, old_carry)

    def store(self, slots: torch.Tensor, drafts: torch.Tensor, proposals: list[Proposal],
              carry: list[tuple[int, torch.Tensor, torch.Tensor]], old_carry: torch.Tensor) -> None:
        """Write drafts, proposals (absent when every row is greedy: greedy verification never reads them)
        and carries into the slots after the chain. carry lists modules 0, 1, ... in order, each with its
        g^m row and whether it ran; old_carry [B, modules, H] is what they held before the step."""
        b, k = self.buffers, drafts.shape[1]
        b.draft_tokens[slots, :k] = drafts
        if proposals and proposals[0][0] is not None:
            b.q_ids[slots, :k] = torch.stack([ids for ids, _ in proposals], 1)
            b.q_probs[slots, :k] = torch.stack([probs for _, probs in proposals], 1)
        if carry:
            n = len(carry)
            new = torch.stack([g for _, g, _ in carry], 1)  # [B, n, H]
            used = torch.stack([u for _, _, u in carry], 1)[..., None]  # [B, n, 1]
            b.carry[slots, :n] = torch.where(used, new, old_carry[:, :n])


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
            argmax = logits.argmax(-1)
            if self.extra is not None:
                self.extra[torch.arange(len(argmax), device=argmax.device), argmax] += 1.0
            return argmax, None, None
        ids, probs = top_m(to_probs(logits, st), m)
        u = uniforms(st.seed, self.frontier + j, STREAM_DRAFT)
        sampled = ids.gather(1, sample(probs, u)[:, None]).squeeze(1)
        tokens = torch.where(st.greedy, logits.argmax(-1), sampled)
        if self.extra is not None:
            self.extra[torch.arange(len(tokens), device=tokens.device), tokens] += 1.0
        return tokens, _pad_m(ids, m), _pad_m(probs, m)


def _pad_m(x: torch.Tensor, m: int) -> torch.Tensor:
    """Small vocabularies give fewer than m entries: pad with zero-probability copies of entry 0."""
    if x.shape[1] == m:
        return x
    pad = x[:, :1].expand(-1, m - x.shape[1])
    return torch.cat((x, torch.zeros_like(pad) if x.is_floating_point() else pad), dim=1)
