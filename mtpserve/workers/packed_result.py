"""A step's packed result, read back on the host into a StepResult (docs/design.md §8).

Per request the device packs one row: [accepted count a, tokens of the window (K + 1)], then, when some
request asked for logprobs, the chosen tokens' logprobs [K + 1] and the top-n ids and values
[(K + 1) * n] (everything then travels as float64, exact for token ids).
"""

from __future__ import annotations

from mtpserve.boundary.messages import StepResult
from mtpserve.workers.state import CachedRequest


def top_logprobs(reqs: list[CachedRequest]) -> int | None:
    """The most top logprobs any request asked for (None: no request asked for logprobs)."""
    asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    return max(asked) if asked else None


def result_from_rows(reqs: list[CachedRequest], rows: list[list[int]] | list[list[float]], k: int) -> StepResult:
    """The StepResult of packed rows (host lists, one per request; k = the window's drafts): each request's
    a accepted drafts plus one sampled token, and its logprobs where asked."""
    accepted = [int(row[0]) for row in rows]
    tokens = [row[1 : a + 2] for row, a in zip(rows, accepted)]
    logprobs: list[list[dict[int, float]] | None] = [None] * len(rows)
    if rows and isinstance(rows[0][0], float):  # logprobs came along: ids travelled as float64
        tokens = [[int(t) for t in ts] for ts in tokens]
        logprobs = [logprob_dicts(row, a, k, r.params.logprobs) for r, row, a in zip(reqs, rows, accepted)]
    return StepResult([r.req_id for r in reqs], tokens, accepted, logprobs)


def logprob_dicts(row: list[float], accepted: int, k: int, n: int | None) -> list[dict[int, float]] | None:
    """Unpack one request's row: token id -> logprob, the chosen token and the top n."""
    if n is None:
        return None
    window, top_n = k + 1, (len(row) - 1 - 2 * (k + 1)) // (2 * (k + 1))
    chosen, lp = row[1 : 1 + window], row[1 + window : 1 + 2 * window]
    ids, vals = row[1 + 2 * window : 1 + 2 * window + window * top_n], row[1 + 2 * window + window * top_n :]
    return [{**{int(i): v for i, v in zip(ids[j * top_n : j * top_n + n], vals[j * top_n : j * top_n + n])},
             int(chosen[j]): lp[j]} for j in range(accepted + 1)]
