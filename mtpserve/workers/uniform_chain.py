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
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, group_metadata
from mtpserve.workers.state import SlotBuffers


class UniformChain:
    def __init__(self, mtp: MTPStack, embed: nn.Embedding, head: nn.Linear, kv: list[LayerKV],
                 buffers: SlotBuffers, state: DeviceState, mode: str, top_m: int, num_modules: int) -> None:
        self.mtp, self.embed, self.head, self.kv = mtp, embed, head, kv
        self.buffers, self.state, self.mode, self.top_m, self.num_modules = buffers, state, mode, top_m, num_modules

    def __call__(self, slots: torch.Tensor, seq_len: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor,
                 target_rows: torch.Tensor, shape, samp: SamplingTensors) -> None:
        """emitted [B, w] (valid up to index a), target_rows [B, w, H]: hidden for module 0."""
        batch, w, k = len(slots), shape.window, shape.chain
        dev, rows = slots.device, torch.arange(len(slots), device=slots.device)
        drafts = torch.zeros(batch, k, dtype=torch.long, device=dev)
        q_ids = torch.zeros(batch, k, self.top_m, dtype=torch.long, device=dev)
        q_probs = torch.zeros(batch, k, self.top_m, dtype=torch.float32, device=dev)
        sampler = DraftSampler(self, slots, seq_len + accepted + 1, samp, shape.flags)
        num_spec = self.state.num_spec[slots]
        carry, prev, last = [], target_rows, None
        for j, step in enumerate(chain_steps(k, self.num_modules, self.mode)):
            m = step.module
            if step.offset == 0:
                q = w + m
                pos = (seq_len - m - 1)[:, None] + torch.arange(q, device=dev)  # [B, q]
                ids = self._module_tokens(emitted, accepted, drafts, q)
                hidden = prev if m == 0 else torch.cat((self.buffers.carry[slots, m - 1][:, None], prev[:, : q - 1]), 1)
                meta = group_metadata(self.state, 1 + m, slots, pos, (num_spec > j)[:, None].expand(-1, q))
                g = self.mtp(m, ids.reshape(-1), hidden.reshape(batch * q, -1), pos.reshape(-1), meta, self.kv[m],
                             self.embed).view(batch, q, -1)
                prev = self.mtp.next_hidden(m, g)
                g, last = g[rows, accepted + m], prev[rows, accepted + m]
                carry.append((m, prev[rows, accepted], num_spec > j))
            else:
                pos = (seq_len + accepted - 1 + step.offset)[:, None]  # [B, 1]: p + offset
                meta = group_metadata(self.state, 1 + m, slots, pos, (num_spec > j)[:, None])
                g = self.mtp(m, drafts[:, j - 1], last, pos.reshape(-1), meta, self.kv[m], self.embed)
                last = self.mtp.next_hidden(m, g)
            drafts[:, j], q_ids[:, j], q_probs[:, j] = sampler(j, self.mtp.logits(m, g, self.head))
        self.store(slots, drafts, q_ids, q_probs, carry, shape.flags.all_greedy)

    @staticmethod
    def _module_tokens(emitted: torch.Tensor, accepted: torch.Tensor, drafts: torch.Tensor, q: int) -> torch.Tensor:
        """Row j's token t_{N+j}: emitted[j] for j <= a, else new draft j - a - 1 (garbage if not drafted yet)."""
        batch, w = emitted.shape
        j = torch.arange(q, device=emitted.device)[None, :].expand(batch, -1)
        from_emitted = emitted.gather(1, j.clamp(max=w - 1))
        from_drafts = drafts.gather(1, (j - accepted[:, None] - 1).clamp(min=0, max=drafts.shape[1] - 1))
        return torch.where(j <= accepted[:, None], from_emitted, from_drafts)

    def store(self, slots: torch.Tensor, drafts: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
               carry: list[tuple[int, torch.Tensor, torch.Tensor]], all_greedy: bool) -> None:
        """Write drafts and carries into the slots after the chain: module m + 1 read the old carry of m."""
        b, k = self.buffers, drafts.shape[1]
        b.draft_tokens[slots, :k] = drafts
        if not all_greedy:  # greedy verification never reads the proposals
            b.q_ids[slots, :k] = q_ids
            b.q_probs[slots, :k] = q_probs
        for m, rows, used in carry:
            b.carry[slots, m] = torch.where(used[:, None], rows, b.carry[slots, m])


class DraftSampler:
    """Samples draft j of every row with the request's own transform (penalties see earlier drafts)."""

    def __init__(self, chain: UniformChain, slots: torch.Tensor, frontier: torch.Tensor, samp: SamplingTensors,
                 flags: SamplingFlags) -> None:
        self.chain, self.slots, self.frontier, self.samp, self.flags = chain, slots, frontier, samp, flags
        self.extra = None
        if flags.penalties:
            self.extra = torch.zeros(len(slots), chain.state.vocab, device=slots.device)

    def __call__(self, j: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [B, V] -> (draft [B], top-M ids [B, M], top-M probs [B, M])."""
        m = self.chain.top_m
        st = self.samp
        if self.extra is not None:
            counts, prompt_mask = self.chain.buffers.penalty_state(self.slots)
            logits = apply_penalties(logits, counts + self.extra, prompt_mask, st)
        if self.flags.all_greedy:  # greedy verification never reads the proposals
            argmax = logits.argmax(-1)
            if self.extra is not None:
                self.extra[torch.arange(len(argmax), device=argmax.device), argmax] += 1.0
            return argmax, argmax[:, None].expand(-1, m), torch.zeros(len(argmax), m, device=logits.device)
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
