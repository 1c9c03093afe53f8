"""Prompt chunks at fixed shapes, resident on the device (docs/design.md §8, "Prefill steps").

The general path plans a prompt chunk's target rows and every module pass from host lists and runs
them eagerly: on a small model that costs far more host time than the GPU needs (about 10 ms per
pass with k = 3). Most chunks have a regular shape, though: request r feeds L_r prompt tokens from
position s_r, and every module it speculates with has committed exactly up to s_r (it is "aligned",
which every fresh prompt is). Then the whole step is a function of a few [R] tensors and the token
ids, at fixed shapes: T flat rows (the chunks back to back, then padding) and R requests (every
request slot, plus the last entry, which owns the padding rows through the pad slot). So it runs as
one CUDA graph per T bucket:

  * target rows at positions s_r + j, j < L_r (the pad slot owns no block: padding is never written);
  * a request whose chunk ends its verified tokens (`final`) samples from its last row with its own
    settings, and the device commits the token (its new length and newest token);
  * module m runs the same rows: position i takes t_{i+m+1} (further down the chunk, or from the
    request's `tail`: the verified tokens past the chunk, or else the sampled token and this step's
    drafts) and g^{m-1}_i (module m - 1's output on the same row; the target's for m = 0). It keeps
    KV below its end (the whole chunk for a final one; else up to N - m - 1, the last position whose
    next m + 1 tokens are verified), drafts from the last row (p = N' - 2) and carries its row at
    the new commit - 1, exactly as the general path does (§3).

Requests that are not aligned (a chunk that ended within m + 1 tokens of the prompt's end, a
resumed request with a forced token, drafts to verify) take the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtpserve.workers.attention import AttentionMetadata
from mtpserve.workers.chain import chain_steps
from mtpserve.workers.kv_cache import KVPools
from mtpserve.workers.models.loader import LoadedModel
from mtpserve.workers.sampling import SamplingTensors
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, window_rows
from mtpserve.workers.state import SlotBuffers
from mtpserve.workers.uniform_chain import DraftSampler, UniformChain
from mtpserve.workers.uniform_step import UniformStep


@dataclass(frozen=True)
class PrefillShape:
    """What fixes a prefill step's kernels: its graph's key."""

    tokens: int  # T: flat rows (>= the chunks' total)
    chain: int  # drafts to produce: the largest num_spec in the batch (0: no chain)
    flags: SamplingFlags


def tail_columns(chain: int, num_modules: int) -> int:
    """Columns of a request's tail: module m reads up to m + 1 tokens past its chunk, and a final chunk's
    sampled token and drafts go to columns 0 .. chain."""
    return max(chain, num_modules) + 2


@dataclass
class PrefillInputs:
    """[R] per-request tensors (unused entries: the pad slot, L = 0), the flat ids and the tails."""

    slots: torch.Tensor
    starts: torch.Tensor  # s: first position of the chunk
    lens: torch.Tensor  # L: rows of the chunk
    verified: torch.Tensor  # N: verified tokens before the step (final when s + L == N)
    ids: torch.Tensor  # [T]: t_s .. t_{s+L-1} of each request, back to back
    tail: torch.Tensor  # [R, tail_columns]: t_{s+L}, t_{s+L+1}, ... as far as verified (zeros after)


@dataclass
class _Passes:
    """Every module pass's layout, built at once: passes differ only by m, so one kernel per tensor serves
    them all (on a small model a pass is mostly launches). [P, ...] each, P module passes."""

    meta: list[AttentionMetadata]  # per pass: KV group 1 + m
    in_chunk: torch.Tensor  # [P, T] whether row i's token input t_{i+m+1} lies in its chunk
    chunk_token: torch.Tensor  # [P, T] that token (where in_chunk)
    tail_at: torch.Tensor  # [P, T] else its flat index in the tail (which the chain's drafts fill)
    read: torch.Tensor  # [P, 2R] rows read back: each request's last row, then its carry row
    moved: torch.Tensor  # [P, R] whether the module's commit moved (then its carry is written)


@dataclass
class _Rows:
    """Where each flat row sits: its request and position (derived on the device)."""

    req: torch.Tensor  # [T]
    index: torch.Tensor  # [T] row within its chunk
    pos: torch.Tensor  # [T]
    first: torch.Tensor  # [R + 1] query start of each request (cumulative lens)
    last: torch.Tensor  # [R] each request's last row (p = N' - 2 for a final chunk)


class PrefillStep:
    def __init__(self, model: LoadedModel, kv: KVPools, buffers: SlotBuffers, state: DeviceState,
                 uniform: UniformStep, num_modules: int, chain_mode: str) -> None:
        self.target, self.kv, self.buffers, self.state, self.uniform = model.target, kv, buffers, state, uniform
        self.mtp, self.num_modules, self.mode = model.mtp, num_modules, chain_mode
        self.hidden_pre_norm = model.config.mtp.hidden_pre_norm

    def __call__(self, x: PrefillInputs, shape: PrefillShape) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (packed [R, 2]: 0 accepted, then the sampled token (final rows only); raw logits [R, V])."""
        self.state.reset_pad()
        final = (x.starts + x.lens == x.verified) & (x.lens > 0)  # [R]
        rows = self._rows(x, shape.tokens)
        meta = self._metadata(slice(0, 1), x, rows)[0]
        hidden = self.target(x.ids, rows.pos, meta, self.kv.target)  # [T, H]
        raw = self.target.logits(hidden[rows.last])  # [R, V] fp32
        samp = self.state.sampling(x.slots, shape.flags)
        no_drafts = x.slots.new_zeros(len(x.slots), 0)
        tokens, accepted = self.uniform.verify(raw, samp, x.slots, no_drafts, x.lens.new_zeros(len(x.slots)),
                                               x.verified, shape.flags)
        self._commit(x, final, tokens[:, 0], shape.flags)
        if self.uniform.chain is not None and shape.chain > 0:
            mtp_rows = hidden if self.hidden_pre_norm else self.target.norm(hidden)
            self._chain(x, rows, final, tokens[:, 0], mtp_rows, shape, samp)
        return torch.cat((accepted[:, None], tokens), dim=1), raw

    @staticmethod
    def _rows(x: PrefillInputs, num_rows: int) -> _Rows:
        ends = torch.cumsum(x.lens, 0)
        first = F.pad(ends, (1, 0))
        req = torch.repeat_interleave(torch.arange(len(x.lens), device=x.lens.device), x.lens, output_size=num_rows)
        index = torch.arange(num_rows, device=x.lens.device) - first[req]
        return _Rows(req, index, x.starts[req] + index, first, (ends - 1).clamp(min=0))

    def _metadata(self, groups: slice, x: PrefillInputs, rows: _Rows, write: torch.Tensor | None = None
                  ) -> list[AttentionMetadata]:
        """The flat rows' attention metadata in each of some KV groups, built at once; a row writes KV only
        where `write` [G, T] holds (None: everywhere) and its position lies in the blocks its request owns
        in that group (else slot -1, which the store skips)."""
        st, bs = self.state, self.state.block_size
        tables = st.tables[groups][:, x.slots]  # [G, R, MB]
        group = torch.arange(tables.shape[0], device=tables.device)[:, None]
        blocks = tables[group, rows.req, (rows.pos // bs).clamp(max=st.max_blocks - 1)].long()  # [G, T]
        owned = rows.pos < st.capacity[groups][:, x.slots[rows.req]]
        owned = owned if write is None else owned & write
        slot_mapping = torch.where(owned, blocks * bs + rows.pos % bs, -1)
        seq_lens = (x.starts + x.lens).to(torch.int32)
        if x.slots.is_cuda:  # host-side bounds only pick tiles; the kernels read lengths on the device
            max_query_len, max_seq_len = len(rows.pos), st.max_blocks * bs
        else:  # the CPU reference pads to these
            max_query_len, max_seq_len = int(x.lens.max()), int(seq_lens.max())
        first = rows.first.to(torch.int32)
        return [AttentionMetadata(first, seq_lens, tables[g], slot_mapping[g], max_query_len, max_seq_len)
                for g in range(tables.shape[0])]

    def _commit(self, x: PrefillInputs, final: torch.Tensor, token: torch.Tensor, flags: SamplingFlags) -> None:
        """Final chunks verified one more token; mid-prompt ones keep their state."""
        st = self.state
        st.seq_len[x.slots] = torch.where(final, x.verified + 1, st.seq_len[x.slots])
        st.last_token[x.slots] = torch.where(final, token, st.last_token[x.slots])
        if flags.penalties:
            self.buffers.add_counts(x.slots, token[:, None], final[:, None].float())

    def _chain(self, x: PrefillInputs, rows: _Rows, final: torch.Tensor, token: torch.Tensor,
               target_rows: torch.Tensor, shape: PrefillShape, samp: SamplingTensors) -> None:
        """Every module pass over the chunks' rows, then the drafts of the final chunks (§3)."""
        chain: UniformChain = self.uniform.chain
        steps = chain_steps(shape.chain, self.num_modules, self.mode)
        tail = x.tail.clone()  # the sampled token and the drafts of final chunks go here
        tail[:, 0] = torch.where(final, token, tail[:, 0])
        drafts, proposals = [], []
        old_carry = self.buffers.carry[x.slots]
        sampler = DraftSampler(chain, x.slots, x.verified + 1, samp, shape.flags)
        num_spec = self.state.num_spec[x.slots]
        passes = self._passes(x, rows, final, num_spec, sum(step.offset == 0 for step in steps), tail.shape[1])
        carry, prev, last, batch = [], target_rows, None, len(x.slots)
        for j, step in enumerate(steps):
            m = step.module
            if step.offset == 0:
                tokens = torch.where(passes.in_chunk[m], passes.chunk_token[m], tail.view(-1)[passes.tail_at[m]])
                g = self.mtp(m, tokens, prev, rows.pos, passes.meta[m], self.kv.mtp[m], self.target.embed_tokens)
                nxt = self.mtp.next_hidden(m, g)
                both = nxt.index_select(0, passes.read[m])  # the last rows, then g^m at the new commit - 1
                last, prev = both[:batch], nxt
                g = last if nxt is g else g.index_select(0, passes.read[m, :batch])
                carry.append(both[batch:])
            else:  # recursive: one row at p + offset from the previous chain step
                meta, p = window_rows(self.state, 1 + m, x.slots, x.verified - 1 + step.offset, 1,
                                      ((num_spec > j) & final).long())
                g = self.mtp(m, drafts[j - 1], last, p, meta, self.kv.mtp[m], self.target.embed_tokens)
                last = self.mtp.next_hidden(m, g)
            token, ids, probs = sampler(j, self.mtp.logits(m, g, self.target.lm_head))
            drafts.append(token)
            proposals.append((ids, probs))
            tail[:, 1 + j] = torch.where(final, token, tail[:, 1 + j])
        chain.store(x.slots, torch.stack(drafts, 1), proposals, carry, passes.moved if carry else None, old_carry)

    def _passes(self, x: PrefillInputs, rows: _Rows, final: torch.Tensor, num_spec: torch.Tensor, num_passes: int,
                tail_columns: int) -> _Passes:
        """The layout of module passes 0 .. num_passes - 1 (module m in pass m), see _Passes. Module m's end
        and commit: a final chunk's module runs to the chunk's end (rows past N' - m - 1 use drafts:
        recomputed next step) and commits N' - m - 1 = N - m; a mid-prompt one runs and commits up to
        N - m - 1 (inputs all verified). Its token input t_{i+m+1} comes from further down the chunk, or
        from the request's tail (the verified tokens past the chunk, or else the sampled token and the
        drafts)."""
        m = torch.arange(num_passes, device=x.slots.device)[:, None]  # [P, 1]
        mid = torch.minimum(x.starts + x.lens, x.verified - m - 1)  # [P, R]
        end = torch.where(final, x.verified, mid)
        commit = torch.where(final, x.verified - m, mid).clamp(min=0)
        used = num_spec > m  # pass m is chain step m
        meta = self._metadata(slice(1, 1 + num_passes), x, rows, used[:, rows.req] & (rows.pos < end[:, rows.req]))
        ahead, lens, total = rows.index + m + 1, x.lens[rows.req], len(x.ids)  # ahead: [P, T]
        chunk_token = x.ids[(torch.arange(total, device=m.device) + m + 1).clamp(max=total - 1)]
        tail_at = rows.req * tail_columns + (ahead - lens).clamp(min=0, max=tail_columns - 1)
        at = rows.first[:-1] + torch.minimum((commit - 1 - x.starts).clamp(min=0), (x.lens - 1).clamp(min=0))
        read = torch.cat((rows.last.expand(num_passes, -1), at.clamp(max=total - 1)), dim=1)
        return _Passes(meta, ahead < lens, chunk_token, tail_at, read, used & (commit > x.starts))
