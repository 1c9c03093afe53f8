"""Worker-side per-request state and the persistent per-slot device buffers.

The scheduler sends diffs (StepPlan); this is where a worker remembers everything else:
verified tokens, how far each KV group is committed, and (on the device) the drafts, their
proposal distributions, the hidden state each MTP module hands to the next, and penalty counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mtpserve.boundary.messages import NewRequest, StepPlan
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams
from mtpserve.workers.device import to_device
from mtpserve.workers.sampling import SamplingTensors, top_k_cap
from mtpserve.workers.slot_state import (FREQUENCY, GREEDY, MIN_P, NUM_SPEC, PRESENCE, REPETITION, SEED, TEMPERATURE,
                                         TOP_K, TOP_P, StateDiffs)


@dataclass
class CachedRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    num_spec: int
    seed: int
    block_ids: list[list[int]]
    slot: int
    num_computed: int = 0  # target positions committed
    mtp_computed: list[int] = field(default_factory=list)  # per module: positions committed
    forced_token: int | None = None  # what the prefill's sample must be (a resumed request's newest token)

    @staticmethod
    def from_new(new: NewRequest, slot: int, num_modules: int) -> "CachedRequest":
        cached = list(new.num_computed) or [0]
        cached += [0] * (1 + num_modules - len(cached))
        return CachedRequest(
            new.request_id, list(new.token_ids), new.num_prompt_tokens, new.params, new.num_spec,
            new.seed, [list(b) for b in new.block_ids], slot, num_computed=cached[0],
            mtp_computed=cached[1 : 1 + num_modules],
            forced_token=new.resume_token,
        )


class SlotBuffers:
    """Device tensors indexed by a request's slot, so per-step updates are batched scatters."""

    def __init__(self, num_slots: int, num_modules: int, hidden: int, vocab: int, top_m: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        # One more row than slots: padded rows of a uniform step point at it (DeviceState.pad_slot).
        k, self.vocab, self.device, rows = MAX_SPECULATIVE_TOKENS, vocab, device, num_slots + 1
        self.draft_tokens = torch.zeros(rows, k, dtype=torch.long, device=device)
        self.q_ids = torch.zeros(rows, k, top_m, dtype=torch.long, device=device)
        self.q_probs = torch.zeros(rows, k, top_m, dtype=torch.float32, device=device)
        self.carry = torch.zeros(rows, max(num_modules, 1), hidden, dtype=dtype, device=device)
        self._counts: torch.Tensor | None = None  # [slots, V] output-token counts, made on first use
        self._prompt_mask: torch.Tensor | None = None  # [slots, V]
        self._free = list(range(num_slots - 1, -1, -1))

    def acquire(self, req: NewRequest) -> int:
        if not self._free:
            raise RuntimeError("no free request slot: more running requests than max_num_seqs")
        slot = self._free.pop()
        if req.params.uses_penalties:
            self._init_penalty_state(slot, req)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def put_drafts(self, slots: torch.Tensor, drafts: torch.Tensor, q_ids: torch.Tensor | None = None,
                   q_probs: torch.Tensor | None = None) -> None:
        """A step's drafts [B, k] for the next verification, with their proposals [B, k, M] unless every row is
        greedy (greedy verification never reads them)."""
        k = drafts.shape[1]
        self.draft_tokens[slots, :k] = drafts
        if q_ids is not None:
            self.q_ids[slots, :k] = q_ids
            self.q_probs[slots, :k] = q_probs

    def penalty_state(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._counts[slots], self._prompt_mask[slots]

    def count_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """Add accepted output tokens to the penalty counts (sampler state advances on accepted tokens only)."""
        if self._counts is not None and tokens:
            idx = to_device(np.array(slots) * self.vocab + np.array(tokens), torch.long, self.device)
            self._counts.view(-1).index_add_(0, idx, torch.ones(len(tokens), device=self.device))

    def add_counts(self, slots: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> None:
        """Device-side form of count_tokens: tokens [B, n] of slots [B], each counted with its weight [B, n]."""
        idx = (slots[:, None] * self.vocab + tokens).reshape(-1)
        self._counts.view(-1).index_add_(0, idx, weights.reshape(-1))

    def _init_penalty_state(self, slot: int, req: NewRequest) -> None:
        if self._counts is None:
            num_slots = self.draft_tokens.shape[0]
            self._counts = torch.zeros(num_slots, self.vocab, device=self.device)
            self._prompt_mask = torch.zeros(num_slots, self.vocab, dtype=torch.bool, device=self.device)
        prompt = torch.tensor(req.token_ids[: req.num_prompt_tokens], device=self.device)
        output = torch.tensor(req.token_ids[req.num_prompt_tokens :], dtype=torch.long, device=self.device)
        self._prompt_mask[slot] = False
        self._prompt_mask[slot, prompt] = True
        self._counts[slot] = torch.bincount(output, minlength=self.vocab).float()


def apply_plan(requests: dict[str, CachedRequest], slots: SlotBuffers, plan: StepPlan, num_modules: int,
               diffs: StateDiffs | None = None) -> None:
    """Drop freed requests, admit new ones, extend block tables: every worker applies each plan the same way.

    With `diffs`, the same changes are recorded for the device-resident state (block tables of the
    groups this worker holds, and the new requests' settings).
    """
    for req_id in plan.freed_ids:
        req = requests.pop(req_id, None)
        if req is not None:
            slots.release(req.slot)
    # This step's drafts per request (adaptive speculation, design §9); a new request is admitted with them,
    # so that one step never writes a slot's num_spec twice (the order of one scatter's writes is undefined).
    specs = dict(zip(plan.req_ids, plan.num_spec)) if plan.new_requests and plan.num_spec else {}
    for new in plan.new_requests:
        req = requests[new.request_id] = CachedRequest.from_new(new, slots.acquire(new), num_modules)
        req.num_spec = specs.get(new.request_id, req.num_spec)
        if diffs is not None:
            record_admission(diffs, req, slots.vocab)
    for req_id, new_blocks in zip(plan.req_ids, plan.new_block_ids):
        if new_blocks:  # [] on most decode steps: no group grew
            req = requests[req_id]
            for group, (table, blocks) in enumerate(zip(req.block_ids, new_blocks)):
                if diffs is not None and blocks and group < diffs.num_groups:
                    diffs.table(group, req.slot, blocks, len(table))
                table.extend(blocks)
    for req_id, num_spec in zip(plan.req_ids, plan.num_spec):  # adaptive speculation's k (design §9)
        req = requests[req_id]
        if req.num_spec != num_spec:
            req.num_spec = num_spec
            if diffs is not None:
                diffs.int_field(NUM_SPEC, req.slot, num_spec)


def record_admission(diffs: StateDiffs, req: CachedRequest, vocab: int) -> None:
    """A new request's block tables, tokens and sampling settings, for the device-resident state."""
    p, slot = req.params, req.slot
    for group, table in enumerate(req.block_ids[: diffs.num_groups]):
        diffs.table(group, slot, table, 0)
    diffs.tokens(slot, req.token_ids)
    for row, value in ((NUM_SPEC, req.num_spec), (TOP_K, p.top_k if 0 < p.top_k < vocab else vocab), (SEED, req.seed)):
        diffs.int_field(row, slot, value)
    for row, value in ((TEMPERATURE, p.temperature if p.temperature > 0 else 1.0), (TOP_P, p.top_p), (MIN_P, p.min_p),
                       (REPETITION, p.repetition_penalty), (PRESENCE, p.presence_penalty),
                       (FREQUENCY, p.frequency_penalty), (GREEDY, float(p.greedy))):
        diffs.float_field(row, slot, value)


def record_emitted(reqs: list[CachedRequest], emitted: list[list[int]], slots: SlotBuffers,
                   diffs: StateDiffs | None = None) -> None:
    """Append each request's verified tokens (accepted drafts + one sampled) and count them for penalties.

    With `diffs`, the device-resident state follows (a general step's tokens: its new length and newest token).
    """
    for r, tokens in zip(reqs, emitted):
        r.token_ids += tokens
        r.forced_token = None
        r.num_computed = len(r.token_ids) - 1
        if diffs is not None:
            diffs.tokens(r.slot, r.token_ids)
    slots.count_tokens([r.slot for r, t in zip(reqs, emitted) for _ in t], [x for t in emitted for x in t])


def at_frontier(reqs: list[CachedRequest], plan: StepPlan, num_modules: int) -> list[bool]:
    """Which requests a uniform step can take: one verified token to feed, the rest drafts, and past the first
    `num_modules` positions (module m's rows start at N - m - 1). A uniform step keeps a request so: after
    it the request is again at its frontier, whatever it accepted."""
    return [n == 1 and r.num_computed == len(r.token_ids) - 1 and len(r.token_ids) > num_modules
            and r.forced_token is None for r, n in zip(reqs, plan.num_tokens)]


def subset(reqs: list[CachedRequest], plan: StepPlan, mask: list[bool], keep: bool
           ) -> tuple[list[CachedRequest], StepPlan]:
    """The requests (and their part of the plan) whose mask entry equals keep."""
    idx = [i for i, m in enumerate(mask) if m == keep]
    return [reqs[i] for i in idx], StepPlan(req_ids=[plan.req_ids[i] for i in idx],
                                            num_tokens=[plan.num_tokens[i] for i in idx],
                                            num_drafts=[plan.num_drafts[i] for i in idx])


@dataclass
class StepLayout:
    """Where each scheduled request's rows sit in the step's flat target batch (host side)."""

    starts: np.ndarray  # [R] first position computed
    n: np.ndarray  # [R] verified tokens computed
    d: np.ndarray  # [R] drafts verified
    final: list[bool]  # reaches its frontier this step (so it samples)
    first_row: np.ndarray  # [R]

    @staticmethod
    def of(reqs: list[CachedRequest], plan: StepPlan) -> "StepLayout":
        starts = np.array([r.num_computed for r in reqs], dtype=np.int64)
        n, d = np.array(plan.num_tokens, dtype=np.int64), np.array(plan.num_drafts, dtype=np.int64)
        final = (starts + n == np.array([len(r.token_ids) for r in reqs])).tolist()
        return StepLayout(starts, n, d, final, np.concatenate(([0], np.cumsum(n + d)[:-1])).astype(np.int64))

    def advance_unfinished(self, reqs: list[CachedRequest]) -> None:
        """Requests mid-prompt committed their chunk (those that sampled were set by record_emitted)."""
        for r, k, is_final in zip(reqs, self.n.tolist(), self.final):
            if not is_final:
                r.num_computed += k


def sampling_tensors(reqs: list[CachedRequest], vocab: int, device: torch.device) -> SamplingTensors:
    """Per-request settings as [R] tensors (greedy rows get temperature 1 so division is safe)."""
    ps = [r.params for r in reqs]

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)

    return SamplingTensors(
        temperature=t([p.temperature if p.temperature > 0 else 1.0 for p in ps], torch.float32),
        top_k=t([p.top_k if p.top_k > 0 else vocab for p in ps], torch.long),
        top_p=t([p.top_p for p in ps], torch.float32),
        min_p=t([p.min_p for p in ps], torch.float32),
        repetition=t([p.repetition_penalty for p in ps], torch.float32),
        presence=t([p.presence_penalty for p in ps], torch.float32),
        frequency=t([p.frequency_penalty for p in ps], torch.float32),
        greedy=t([p.greedy for p in ps], torch.bool),
        seed=t([r.seed for r in reqs], torch.long),
        use_penalties=any(p.uses_penalties for p in ps),
        use_top_k=any(0 < p.top_k < vocab for p in ps),
        use_top_p=any(p.top_p < 1.0 for p in ps),
        use_min_p=any(p.min_p > 0.0 for p in ps),
        all_greedy=all(p.greedy for p in ps),
        top_k_cap=top_k_cap([p.top_k for p in ps], vocab),
    )

