"""Boundary dataclasses between the scheduler and the workers (docs/design.md §2).

A StepPlan carries only what changed since the last step; workers keep their own per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the workers have not seen (or see again after preemption, with its KV recomputed)."""

    request_id: str
    token_ids: list[int]  # every verified token: prompt plus output so far
    num_prompt_tokens: int
    params: SamplingParams
    num_spec: int  # draft tokens per step for this request
    seed: int
    block_ids: list[list[int]]  # per KV group: target, then MTP module 0, 1, ...
    # Resumed after preemption or a worker's loss: the newest verified token, left out of token_ids. The
    # prefill "samples" it (forced), so the drafts verified next equal those of an undisturbed run.
    resume_token: int | None = None
    # Per KV group: positions whose KV the blocks above already hold (a prefix-cache hit); the same
    # for every group the request uses (mtpserve/cluster/block_manager.py says why), 0 for the others.
    num_computed: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    new_requests: list[NewRequest] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)  # scheduled requests, in batch order
    num_tokens: list[int] = field(default_factory=list)  # verified tokens to compute per request
    num_drafts: list[int] = field(default_factory=list)  # drafts to verify (only when reaching the frontier)
    # Per request, per group: appended blocks; [] when no group grew (most decode steps).
    new_block_ids: list[list[list[int]]] = field(default_factory=list)
    freed_ids: list[str] = field(default_factory=list)  # finished, aborted or preempted: drop worker state
    # Per request: drafts its chain makes this step (adaptive speculation chooses it per step, at most the
    # request's num_spec; docs/design.md §9). Empty: every request's own num_spec.
    num_spec: list[int] = field(default_factory=list)
    # Positions the workers recompute beyond num_tokens so that lagging modules catch up (docs/design.md §9), as
    # the scheduler counted them against the step's token budget: such a step is no plain decode step.
    catch_up_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.num_tokens) + sum(self.num_drafts) + self.catch_up_tokens  # what the budget counted


@dataclass
class StepResult:
    """What the workers sampled: for each request that reached its frontier, accepted drafts + one token."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    # The uniform step's own time on the device (CUDA events from its first copy to its result's copy;
    # 0: not timed there), the device share of adaptive speculation's step costs (design §9).
    device_seconds: float = 0.0
    # Of the executor's wait for this result, the seconds the host sat blocked on the device (0: not timed):
    # the rest of the wait (reading the packed rows back into lists) is host work like any other.
    blocked_seconds: float = 0.0
