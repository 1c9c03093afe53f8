"""Engine statistics as plain data; the Prometheus logger (cluster/metrics.py) turns them into metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS


@dataclass
class SpecCounters:
    """Cumulative speculation counters (docs/design.md §7: per draft position)."""

    num_drafts: int = 0  # verification steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)
    drafted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """A step's verifications: per request, drafts verified and of them accepted (0 drafts: none). Counted
        per distinct count, not per draft: a step of 256 requests holds at most K + 1 of them."""
        verified = [(d, a) for d, a in zip(num_drafts, num_accepted) if d > 0]
        if not verified:
            return
        drafted, accepted = Counter(d for d, _ in verified), Counter(a for _, a in verified)
        self.num_drafts += len(verified)
        self.num_draft_tokens += sum(d * n for d, n in drafted.items())
        self.num_accepted_tokens += sum(a * n for a, n in accepted.items())
        for counts, per_position in ((drafted, self.drafted_per_position), (accepted, self.accepted_per_position)):
            for upto, n in counts.items():  # positions 0 .. upto - 1
                for j in range(upto):
                    per_position[j] += n

    def add(self, other: "SpecCounters") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, (a, d) in enumerate(zip(other.accepted_per_position, other.drafted_per_position)):
            self.accepted_per_position[j] += a
            self.drafted_per_position[j] += d

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class StepStats:
    """One engine step, for the metrics logger."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: list[float] = field(default_factory=list)  # per KV group: target, mtp0, mtp1, ...
    batch_size: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0  # tokens emitted this step
    num_preemptions: int = 0
    prefix_cache_queries: list[int] = field(default_factory=list)  # per KV group: prompt tokens looked up
    prefix_cache_hits: list[int] = field(default_factory=list)  # per KV group: tokens whose KV was reused
    schedule_seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    spec: SpecCounters = field(default_factory=SpecCounters)  # this step's speculation
    spec_k: int | None = None  # adaptive speculation: the k chosen for this step (None: not adaptive)
    acceptance_estimate: list[float] = field(default_factory=list)  # engine-wide, per draft position
