"""Prompt chunks at fixed shapes, resident on the device (docs/design.md §8, "Prefill steps").

The general path plans a prompt chunk's target rows and every module pass from host lists and runs
them eagerly: on a small model that costs far more host time than the GPU needs (about 10 ms per
pass with k = 3). Most chunks have a regular shape, though: request r feeds L_r prompt tokens from
position s_r, and every module it speculates with has committed exactly up to s_r (it is "aligned",
which every fresh prompt is). Then the whole chunk is a function of a few [B] tensors and the chunk's
token ids, at fixed shapes (B requests x Q rows, Q >= every L_r), so it runs as one CUDA graph:

  * target rows j < L_r at positions s_r + j (rows past L_r are padding: slot -1, never written);
  * a request whose chunk ends its verified tokens (`final`) samples from row L_r - 1 with its own
    settings, and the device commits the token (its new length and newest token);
  * module m runs the same rows: position i takes t_{i+m+1} (the chunk's ids shifted by m + 1, then
    the sampled token and this step's drafts) and g^{m-1}_i (module m - 1's output on the same row;
    the target row for m = 0). It keeps KV below its end (the whole chunk for a final one; else up
    to N - m - 1, the last position whose next m + 1 tokens are verified), drafts from row L_r - 1
    (p = N' - 2) and carries its row at the new commit - 1, exactly as the general path (§3).

Requests that are not aligned (a chunk that ended within m + 1 tokens of the prompt's end, a
resumed request with a forced token, drafts to verify) take the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.workers.chain import chain_steps
from mtpserve.workers.kv_cache import KVPools
from mtpserve.workers.models.loader import LoadedModel
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, group_metadata
from mtpserve.workers.state import SlotBuffers
from mtpserve.workers.uniform_chain import DraftSampler, UniformChain
from mtpserve.workers.uniform_step import UniformStep


@dataclass(frozen=True)
class PrefillShape:
    """What fixes a prefill step's kernels: part of its graph's key together with the batch bucket."""

    rows: int  # Q: rows per request (>= the longest chunk)
    chain: int  # drafts to produce: the largest num_spec in the batch (0: no chain)
    flags: SamplingFlags


def id_columns(rows: int, chain: int, num_modules: int) -> int:
    """Columns of the id buffer: the chunk, then what module passes read past it (module m reads up to
    column L + m) and where the sampled token and the drafts go (columns L .. L + chain)."""
    return rows + max(chain, num_modules) + 2


@dataclass
class PrefillInputs:
    """[B] per-request tensors of a prefill step (padded rows: the pad slot, L = 0)."""

    slots: torch.Tensor
    starts: torch.Tensor  # s: first position of the chunk
    lens: torch.Tensor  # L: tokens in the chunk
    verified: torch.Tensor  # N: verified tokens before the step (final when s + L == N)
    ids: torch.Tensor  # [B, id_columns]: t_s, t_{s+1}, ... as far as verified (zeros after)


class PrefillStep:
    def __init__(self, model: LoadedModel, kv: KVPools, buffers: SlotBuffers, state: DeviceState,
                 uniform: UniformStep, num_modules: int, chain_mode: str) -> None:
        self.target, self.kv, self.buffers, self.state, self.uniform = model.target, kv, buffers, state, uniform
        self.mtp, self.num_modules, self.mode = model.mtp, num_modules, chain_mode
        self.hidden_pre_norm = model.config.mtp.hidden_pre_norm

    def __call__(self, x: PrefillInputs, shape: PrefillShape) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (packed [B, 2]: 0 accepted then the sampled token (final rows only); raw logits [B, V])."""
        st, q, batch = self.state, shape.rows, len(x.slots)
        st.reset_pad()
        final = x.starts + x.lens == x.verified  # [B]
        pos = x.starts[:, None] + torch.arange(q, device=x.slots.device)  # [B, Q]
        inside = pos < (x.starts + x.lens)[:, None]
        meta = group_metadata(st, 0, x.slots, pos, inside)
        hidden = self.target(x.ids[:, :q].reshape(-1), pos.reshape(-1), meta, self.kv.target).view(batch, q, -1)
        rows, last = torch.arange(batch, device=x.slots.device), (x.lens - 1).clamp(min=0)
        raw = self.target.logits(hidden[rows, last])  # [B, V] fp32
        samp = st.sampling(x.slots, shape.flags)
        no_drafts = x.slots.new_zeros(batch, 0)
        tokens, accepted = self.uniform.verify(raw, samp, x.slots, no_drafts, x.lens.new_zeros(batch), x.verified,
                                               shape.flags)
        self._commit(x, final, tokens[:, 0], shape.flags)
        if self.uniform.chain is not None and shape.chain > 0:
            mtp_rows = hidden if self.hidden_pre_norm else self.target.norm(hidden)
            self._chain(x, final, tokens[:, 0], mtp_rows, pos, shape, samp)
        return torch.cat((accepted[:, None], tokens), dim=1), raw

    def _commit(self, x: PrefillInputs, final: torch.Tensor, token: torch.Tensor, flags: SamplingFlags) -> None:
        """Final rows verified one more token; mid-prompt rows keep their state."""
        st = self.state
        st.seq_len[x.slots] = torch.where(final, x.verified + 1, st.seq_len[x.slots])
        st.last_token[x.slots] = torch.where(final, token, st.last_token[x.slots])
        if flags.penalties:
            self.buffers.add_counts(x.slots, token[:, None], final[:, None].float())

    def _chain(self, x: PrefillInputs, final: torch.Tensor, token: torch.Tensor, target_rows: torch.Tensor,
               pos: torch.Tensor, shape: PrefillShape, samp) -> None:
        """Every module pass over the chunk's rows, then the drafts of the final rows (§3)."""
        chain: UniformChain = self.uniform.chain
        batch, q, k, dev = len(x.slots), shape.rows, shape.chain, x.slots.device
        rows, drafting_row = torch.arange(batch, device=dev), (x.lens - 1).clamp(min=0)
        seq = x.ids.clone()  # t_{s + c}: the sampled token and the drafts are written past the chunk
        seq[rows, x.lens] = torch.where(final, token, seq[rows, x.lens])
        drafts = torch.zeros(batch, k, dtype=torch.long, device=dev)
        q_ids = torch.zeros(batch, k, chain.top_m, dtype=torch.long, device=dev)
        q_probs = torch.zeros(batch, k, chain.top_m, dtype=torch.float32, device=dev)
        sampler = DraftSampler(chain, x.slots, x.verified + 1, samp, shape.flags)
        num_spec = self.state.num_spec[x.slots]
        carry, prev, last = [], target_rows, None
        for j, step in enumerate(chain_steps(k, self.num_modules, self.mode)):
            m, used = step.module, (num_spec > j)
            if step.offset == 0:
                commit = self._module_commit(x, final, m)
                write = used[:, None] & (pos < self._module_end(x, final, m)[:, None])
                meta = group_metadata(self.state, 1 + m, x.slots, pos, write)
                g = self.mtp(m, seq[:, m + 1 : m + 1 + q].reshape(-1), prev.reshape(batch * q, -1), pos.reshape(-1),
                             meta, self.kv.mtp[m], self.target.embed_tokens).view(batch, q, -1)
                prev = self.mtp.next_hidden(m, g)
                g, last = g[rows, drafting_row], prev[rows, drafting_row]
                moved = used & (commit > x.starts)
                carry.append((m, prev[rows, (commit - 1 - x.starts).clamp(min=0, max=q - 1)], moved))
            else:  # recursive: one row at p + offset from the previous chain step
                p = (x.verified - 1 + step.offset)[:, None]
                meta = group_metadata(self.state, 1 + m, x.slots, p, (used & final)[:, None])
                g = self.mtp(m, drafts[:, j - 1], last, p.reshape(-1), meta, self.kv.mtp[m], self.target.embed_tokens)
                last = self.mtp.next_hidden(m, g)
            drafts[:, j], q_ids[:, j], q_probs[:, j] = sampler(j, self.mtp.logits(m, g, self.target.lm_head))
            col = (x.lens + 1 + j).clamp(max=seq.shape[1] - 1)
            seq[rows, col] = torch.where(final, drafts[:, j], seq[rows, col])
        chain.store(x.slots, drafts, q_ids, q_probs, carry, shape.flags.all_greedy)

    @staticmethod
    def _module_end(x: PrefillInputs, final: torch.Tensor, m: int) -> torch.Tensor:
        """[B] position past module m's last row: the chunk's end when final (the rows past the new
        commit use drafts and are recomputed next step), else its last position with verified inputs."""
        return torch.where(final, x.verified, torch.minimum(x.starts + x.lens, x.verified - m - 1))

    @staticmethod
    def _module_commit(x: PrefillInputs, final: torch.Tensor, m: int) -> torch.Tensor:
        """[B] module m's committed positions after the step (N' - m - 1 when final, N' = N + 1)."""
        return torch.where(final, x.verified - m, torch.minimum(x.starts + x.lens, x.verified - m - 1)).clamp(min=0)
