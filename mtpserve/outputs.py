"""What a finished (or streaming) request returns to callers of LLM, the engine and the router."""

from __future__ import annotations

from dataclasses import dataclass, field

# Per generated token: token id -> log probability, covering the chosen token and the top-N.
CompletionLogprobs = list[dict[int, float]]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # all generated tokens so far
    text: str = ""  # detokenized generated text so far (stop strings removed)
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    accepted_per_step: list[int] = field(default_factory=list)  # accepted drafts per verification step
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the last step (streaming)
    new_text: str = ""  # text added by the last step (streaming)
    new_logprobs: CompletionLogprobs | None = None  # logprobs of new_token_ids (streaming)
    # Wall-clock times (time.monotonic) for latency metrics: queue time, TTFT, end to end.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_step)
