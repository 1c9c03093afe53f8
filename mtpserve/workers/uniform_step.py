"""The uniform speculative step at fixed shapes, resident on the device (docs/design.md §8).

A step is uniform when every scheduled request sits at its frontier: it feeds its newest verified
token plus its drafts to the target and samples. Then the whole step (target window, verification,
the MTP chain, draft sampling, state updates) is a function of the slot list and the number of drafts
to verify, with shapes fixed by (batch, window, chain length): no host lists, no host reads, one CUDA
graph per shape (mtpserve/workers/uniform_graphs.py). Every request gets `window` target rows; rows
past its own drafts compute garbage that is never verified and never written to a pool it does not
own (its block capacity bounds every KV write).

With a drafter group (docs/design.md §2) the chain runs on the drafter ranks: the step then has no chain
here and leaves the rows module 0 reads in a persistent `handoff` buffer (a graph's output must stay at
one address), which rank 0 sends to the group after the step, with the packed result
(mtpserve/workers/drafter_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.boundary.messages import StepPlan
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS
from mtpserve.workers.kv_cache import KVPools
from mtpserve.workers.models.loader import LoadedModel
from mtpserve.workers.rejection import greedy_accepted, verify_seeded
from mtpserve.workers.sampling import SamplingTensors, apply_penalties, argmax_rows, to_probs
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, window_rows
from mtpserve.workers.state import CachedRequest, SlotBuffers
from mtpserve.workers.uniform_chain import UniformChain


@dataclass(frozen=True)
class StepShape:
    """What fixes a uniform step's kernels: part of its graph's key together with the batch bucket."""

    window: int  # target rows per request: 1 + the most drafts any request verifies
    chain: int  # drafts to produce: the largest num_spec in the batch (0: no chain)
    flags: SamplingFlags

    @staticmethod
    def of(reqs: list[CachedRequest], plan: StepPlan, flags: SamplingFlags, num_modules: int) -> "StepShape":
        """The shape of a uniform step over reqs (every process of a replica derives the same one)."""
        specs = plan.num_spec or [r.num_spec for r in reqs]
        chain = max(specs) if num_modules else 0
        # The window is padded to the chain (rows past a request's own drafts are masked): a step that verifies
        # fewer drafts than it makes (k just rose, or max_tokens is near) then reuses the graph captured at
        # start for its k instead of capturing one of its own in the middle of serving.
        return StepShape(1 + max(max(plan.num_drafts), chain), chain, flags)


class UniformStep:
    def __init__(self, model: LoadedModel, kv: KVPools, buffers: SlotBuffers, state: DeviceState,
                 chain_mode: str, top_m: int, num_modules: int, handoff: bool = False) -> None:
        self.target, self.buffers, self.state, self.kv = model.target, buffers, state, kv
        self.chain = UniformChain(model.mtp, model.target.embed_tokens, model.target.lm_head, kv.mtp, buffers,
                                  state, chain_mode, top_m, num_modules) if num_modules else None
        self.hidden_pre_norm = model.config.mtp.hidden_pre_norm
        self.handoff: torch.Tensor | None = None  # flat [batch * window * H] rows for a drafter group's module 0
        if handoff:
            cfg = model.config
            rows = state.pad_slot * (1 + MAX_SPECULATIVE_TOKENS) * cfg.hidden_size  # the largest batch and window
            self.handoff = torch.empty(rows, dtype=buffers.carry.dtype, device=state.device)

    def __call__(self, slots: torch.Tensor, num_drafts: torch.Tensor, shape: StepShape
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """slots, num_drafts [B] -> (packed [B, 1 + window]: accepted count then tokens; raw logits [B*w, V],
        fp32 unless the batch is plain greedy)."""
        st, w = self.state, shape.window
        st.reset_pad()
        seq_len = st.seq_len[slots]  # [B] verified tokens before this step
        ids = torch.cat((st.last_token[slots][:, None], self.buffers.draft_tokens[slots, : w - 1]), dim=1)
        meta, pos = window_rows(st, 0, slots, seq_len - 1, w, num_drafts + 1)  # rows past the drafts write nothing
        hidden, normed = self.target.forward_normed(ids.reshape(-1), pos, meta, self.kv.target)  # [B*w, H] each
        # [B*w, V]: a plain greedy batch verifies by argmax, which the upcast would not change (logprobs upcast)
        raw = self.target.head_logits(normed, fp32=not shape.flags.all_greedy or shape.flags.penalties)
        samp = st.sampling(slots, shape.flags)
        tokens, accepted = self.verify(raw, samp, slots, ids[:, 1:], num_drafts, seq_len, shape.flags)
        frontier = commit(st, self.buffers, slots, seq_len, accepted, tokens, shape.flags)
        rows = (hidden if self.hidden_pre_norm else normed).view(len(slots), w, -1)  # what module 0 reads
        if self.chain is not None and shape.chain > 0:
            self.chain(slots, seq_len, frontier, accepted, tokens, rows, shape, samp)
        if self.handoff is not None:
            self.handoff[: rows.numel()].view(rows.shape).copy_(rows)
        return torch.cat((accepted[:, None], tokens), dim=1), raw

    def handed_off(self, batch: int, window: int) -> torch.Tensor:
        """The last step's module-0 rows of its first `batch` requests [batch, window, H] (valid until the next)."""
        return self.handoff[: batch * window * self.buffers.carry.shape[-1]].view(batch, window, -1)

    def verify(self, raw: torch.Tensor, samp: SamplingTensors, slots: torch.Tensor, drafts: torch.Tensor,
                num_drafts: torch.Tensor, seq_len: torch.Tensor, flags: SamplingFlags
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens [B, w]: accepted drafts, then the emitted token at index a; accepted a [B])."""
        batch, k = drafts.shape
        logits = self._penalised(raw, samp, slots, drafts) if flags.penalties else raw
        argmax = argmax_rows(logits).view(batch, k + 1)
        if flags.all_greedy:  # exact and cheap: no distributions at all
            # An accepted draft equals the argmax at its position, so the argmax row is already the accepted
            # drafts followed by the emitted token (what lies past index a is never read).
            return argmax, greedy_accepted(drafts, argmax, num_drafts)
        probs = to_probs(logits.view(batch, k + 1, -1), samp)
        b = self.buffers
        return verify_seeded(probs, argmax, drafts, b.q_ids[slots, :k], b.q_probs[slots, :k], num_drafts, samp.greedy,
                             samp.seed, seq_len)

    def _penalised(self, raw: torch.Tensor, samp: SamplingTensors, slots: torch.Tensor,
                   drafts: torch.Tensor) -> torch.Tensor:
        """Penalties at window position j see the drafts before j, as they would see accepted tokens."""
        batch, k = drafts.shape
        counts, prompt_mask = self.buffers.penalty_state(slots)  # [B, V]
        drafted = torch.zeros(batch, k + 1, counts.shape[-1], device=raw.device)
        drafted[:, 1:].scatter_add_(2, drafts[..., None], torch.ones_like(drafts[..., None], dtype=torch.float))
        window = (counts[:, None] + drafted.cumsum(dim=1)).view(-1, counts.shape[-1])
        rows = torch.arange(batch, device=raw.device).repeat_interleave(k + 1)
        return apply_penalties(raw, window, prompt_mask[rows], samp.take(rows))


def commit(state: DeviceState, buffers: SlotBuffers, slots: torch.Tensor, seq_len: torch.Tensor,
           accepted: torch.Tensor, tokens: torch.Tensor, flags: SamplingFlags) -> torch.Tensor:
    """Advance the verified state on the device (every rank that holds it, from the same packed result); sampler
    state moves on accepted tokens only. Returns the verified tokens after the step [B]."""
    rows = torch.arange(len(slots), device=slots.device)
    frontier = seq_len + accepted + 1
    state.seq_len[slots] = frontier
    state.last_token[slots] = tokens[rows, accepted]
    if flags.penalties:
        kept = (torch.arange(tokens.shape[1], device=slots.device)[None, :] <= accepted[:, None]).float()
        buffers.add_counts(slots, tokens, kept)
    return frontier
