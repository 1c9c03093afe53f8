"""Router-side state of one request: its tokens, progress and finish condition."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mtpserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: list.remove must not compare every field of every request
class Request:
    request_id: str
    token_ids: list[int]  # prompt + verified output
    num_prompt_tokens: int
    params: SamplingParams
    num_spec: int
    seed: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    arrival_time: float
    status: Status = Status.WAITING
    num_computed: int = 0  # target KV positions committed
    num_drafts: int = 0  # drafts the workers hold for the next verification
    # The furthest end (num_computed + tokens + drafts) a step can reach without new KV blocks in any group
    # the request uses, drafting included (-1: unknown): a decode step then skips the block manager.
    kv_room: int = -1
    finish_reason: str | None = None
    accepted_per_step: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    resume_token: int | None = None  # held out of token_ids while its KV is recomputed (NewRequest.resume_token)
    block_hashes: list[list[bytes]] = field(default_factory=list)  # per KV group: prefix-cache hash chain
    queued_at_step: int = 0  # the scheduler's step count when it queued the request (prefill_hold_steps)
    # Adaptive speculation (docs/design.md §9): num_spec is then the upper bound and each step chooses k.
    adaptive: bool = False
    spec_row: int = -1  # the request's row in the scheduler's AdaptiveSpec while it runs
    # Where its MTP modules may first lag from (a step ran fewer drafts than num_spec): module blocks past
    # it are not offered to the prefix cache (their entries may not be the teacher-forced ones).
    modules_exact_upto: int | None = None
    live_spec: int = -1  # drafts whose modules are all committed to the frontier (-1: all of num_spec)
    # Per module (module m at m - 1), where it began to lag: a catch-up rewinds about to the highest module's entry.
    # Those up to live_spec are stale. (One point per request made a probe 2 -> 1 -> 2 rewind from the fall to 2.)
    lag_from: list[int] | None = None
    catch_up_owed: int = 0  # the spec a rise of k found the step's budget too full for: MAX_CATCH_UP no longer stops it

    def __post_init__(self) -> None:
        # Built once: append_verified runs per request per step, on the engine's hot path.
        self._stops = frozenset(self.params.stop_token_ids) | frozenset(
            () if self.params.ignore_eos else self.eos_token_ids)
        # The length token_ids may reach: max_tokens outputs, within the context (asked twice per request per step).
        self._length_limit = min(self.num_prompt_tokens + self.params.max_tokens, self.max_model_len)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def tokens_left(self) -> int:
        """How many more tokens this request may still produce."""
        return self._length_limit - len(self.token_ids)

    def append_verified(self, tokens: list[int]) -> int:
        """Append sampled tokens up to the first stop condition; returns how many were kept."""
        stops, left = self._stops, self.tokens_left
        for i, token in enumerate(tokens):
            if token in stops:
                self.finish_reason = "stop"
            elif i + 1 >= left:  # no tokens left once this one is appended
                self.finish_reason = "length"
            else:
                continue
            self.token_ids += tokens[: i + 1]
            return i + 1
        self.token_ids += tokens
        return len(tokens)
