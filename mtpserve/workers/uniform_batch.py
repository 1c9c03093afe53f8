"""What a uniform step derives from its requests alone, kept while the batch stays the same.

A decode batch is usually the same requests step after step; per step the host then compares the
request ids (a list comparison in C) instead of walking every request's sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtpserve.workers.packed_result import top_logprobs
from mtpserve.workers.slot_state import SamplingFlags, sampling_flags
from mtpserve.workers.state import CachedRequest


@dataclass(frozen=True)
class UniformBatch:
    req_ids: list[str]
    slots: np.ndarray  # [R] int64: each request's slot in the device-resident state
    flags: SamplingFlags
    top_logprobs: int | None  # the most top logprobs any request asked for (None: none asked)


class UniformBatches:
    """The last step's UniformBatch, made again when its requests changed."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._last: UniformBatch | None = None

    def forget(self) -> None:
        """Requests were freed or admitted: an id seen again may now name another request (a resumed one)."""
        self._last = None

    def of(self, reqs: list[CachedRequest], req_ids: list[str]) -> UniformBatch:
        last = self._last
        if last is None or last.req_ids != req_ids:
            slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=len(reqs))
            last = self._last = UniformBatch(list(req_ids), slots, sampling_flags([r.params for r in reqs], self.vocab),
                                             top_logprobs(reqs))
        return last
