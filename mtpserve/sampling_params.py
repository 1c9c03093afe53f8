"""Per-request sampling settings, validated on construction (errors name the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mtpserve.errors import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 8
# num_speculative_tokens = "auto": the engine chooses the drafts per step (docs/design.md §9). In gRPC, whose
# field is an int32, the same is said with SPEC_AUTO_WIRE.
SPEC_AUTO = "auto"
SPEC_AUTO_WIRE = -1
SpecTokens = int | str | None  # a number of drafts, "auto", or None (the engine's default)


def parse_spec_tokens(text: str) -> int | str:
    """A flag's value: "auto" or a number of drafts (range checks are the config's and the request's)."""
    return SPEC_AUTO if text.strip().lower() == SPEC_AUTO else int(text)


def valid_spec_tokens(value: object) -> bool:
    return value is None or value == SPEC_AUTO or (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SPECULATIVE_TOKENS)
# Every step searches the new text for each stop string: bound the work one request can ask for.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """The settings vLLM users know. temperature 0 is greedy; top_k -1 and top_p 1 disable those filters.

    Penalties follow vLLM: repetition_penalty scales logits of tokens seen in the prompt or output
    (>1 discourages), presence/frequency penalties subtract per output-token occurrence.
    `num_speculative_tokens` None takes the engine default; 0 turns speculation off for this request; "auto"
    lets the engine choose each step's drafts (at most its own limit), a number fixes them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    num_speculative_tokens: SpecTokens = None

    def __post_init__(self) -> None:
        # Accept lists (and a single stop string) from callers, keep tuples so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _validate(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, f"must be >= 1, got {self.max_tokens}"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0,
             f"must be finite and >= 0, got {self.temperature}"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, f"must be -1 (off) or >= 1, got {self.top_k}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"must be in (0, 1], got {self.top_p}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"must be in [0, 1], got {self.min_p}"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0,
             f"must be in (0, 10], got {self.repetition_penalty}"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             f"must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, f"must be in [0, 20], got {self.logprobs}"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, f"must be in [0, 2**63), got {self.seed}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"),
            ("stop", all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"each at most {MAX_STOP_STRING_CHARS} characters, got one of "
             f"{max((len(s) for s in self.stop if isinstance(s, str)), default=0)}"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative token ids"),
            ("num_speculative_tokens", valid_spec_tokens(self.num_speculative_tokens),
             f"must be \"auto\" or in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise InvalidRequestError(name, message)
