"""Runs prefill steps (mtpserve/workers/prefill_step.py): which chunks qualify, one pinned copy in, a
CUDA-graph replay per (batch bucket, row bucket, PrefillShape), one result out.

Per step the host sends one int64 buffer: per request its slot, chunk start, chunk length and verified
length, then the chunk's ids [B, columns], then the state diffs since the last step. Batches pad to a
batch bucket (pad slot, L = 0) and chunks to a power-of-two row count, as long as the padded step stays
within `max_rows` rows (larger prompts are compute-bound: the eager general path costs them little
extra, and a graph per large shape would hold much memory). Off CUDA the step runs eagerly at the
batch's own size and its longest chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.cuda_graphs import batch_buckets, capture_graph
from mtpserve.workers.prefill_step import PrefillInputs, PrefillShape, PrefillStep, id_columns
from mtpserve.workers.slot_state import DeviceState, StateDiffs, sampling_flags
from mtpserve.workers.state import CachedRequest

MIN_ROWS = 16


@dataclass
class _Graph:
    inputs: torch.Tensor  # static int64 buffer: slots, starts, lens, verified [B each], ids [B * columns]
    graph: torch.cuda.CUDAGraph
    out: tuple[torch.Tensor, torch.Tensor]


class PrefillGraphs:
    def __init__(self, step: PrefillStep, state: DeviceState, max_num_seqs: int, max_rows: int,
                 num_modules: int, device: torch.device, use_graphs: bool) -> None:
        self.step, self.state, self.device, self.num_modules = step, state, device, num_modules
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pad = self.use_graphs  # tests pad on CPU too, to check that padded rows change nothing
        self.max_rows = max_rows
        self.buckets = batch_buckets(max_num_seqs)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[tuple[int, PrefillShape], _Graph] = {}
        self.runs = self.replays = 0
        self.on_capture: Callable[[], None] | None = None

    def takes(self, reqs: list[CachedRequest], plan: StepPlan) -> list[bool]:
        """Which requests' chunks a prefill step can run: no drafts, no forced token, every module of
        the chain committed exactly to the chunk's start, and the padded step within max_rows."""
        ok = [d == 0 and r.forced_token is None
              and all(c == r.num_computed for c in r.mtp_computed[: min(r.num_spec, self.num_modules)])
              for r, d in zip(reqs, plan.num_drafts)]
        lens = [n for n, o in zip(plan.num_tokens, ok) if o]
        if not lens or (self.pad and self._padded(len(lens), max(lens))[0] * self._rows(max(lens)) > self.max_rows):
            return [False] * len(reqs)
        return ok

    def run(self, reqs: list[CachedRequest], lens: list[int], diffs: StateDiffs) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch the step -> (packed [R, 2], raw logits [R, V]); valid until the next replay."""
        self.runs += 1
        r, longest = len(reqs), max(lens)
        batch, rows = self._padded(r, longest)
        chain = max(q.num_spec for q in reqs) if self.num_modules else 0
        shape = PrefillShape(rows, chain, sampling_flags([q.params for q in reqs], self.state.vocab))
        packed, counts = diffs.pack(self._head(reqs, lens, batch, id_columns(rows, chain, self.num_modules)),
                                    self.device)  # the step's one host-to-device copy
        head = 4 * batch + batch * id_columns(rows, chain, self.num_modules)
        self.state.apply(packed[head:], counts)
        if not self.use_graphs:
            out, raw = self.step(self._inputs(packed[:head], batch), shape)
        else:
            g = self.graphs.get((batch, shape)) or self._capture(batch, shape)
            g.inputs.copy_(packed[:head])
            g.graph.replay()
            out, raw = g.out
            self.replays += 1
        return out[:r], raw[:r]

    def _padded(self, num_reqs: int, longest: int) -> tuple[int, int]:
        """-> (batch, rows) of the step that runs num_reqs chunks of at most `longest` tokens."""
        if not self.pad:
            return num_reqs, longest
        return next(b for b in self.buckets if b >= num_reqs), self._rows(longest)

    def _rows(self, longest: int) -> int:
        return max(MIN_ROWS, 1 << (longest - 1).bit_length()) if self.pad else longest

    def _head(self, reqs: list[CachedRequest], lens: list[int], batch: int, columns: int) -> np.ndarray:
        """slots, starts, lens, verified [batch each] (pad rows: pad slot, zeros), then ids [batch, columns]."""
        r = len(reqs)
        head = np.zeros(4 * batch + batch * columns, dtype=np.int64)
        head[:batch] = self.state.pad_slot
        head[:r] = [q.slot for q in reqs]
        head[batch : batch + r] = [q.num_computed for q in reqs]
        head[2 * batch : 2 * batch + r] = lens
        head[3 * batch : 3 * batch + r] = [len(q.token_ids) for q in reqs]
        ids = head[4 * batch :].reshape(batch, columns)
        for i, q in enumerate(reqs):  # one slice per request: the chunk and the verified tokens past it
            chunk = q.token_ids[q.num_computed : q.num_computed + columns]
            ids[i, : len(chunk)] = chunk
        return head

    def _inputs(self, buf: torch.Tensor, batch: int) -> PrefillInputs:
        slots, starts, lens, verified = buf[: 4 * batch].view(4, batch)
        return PrefillInputs(slots, starts, lens, verified, buf[4 * batch :].view(batch, -1))

    def _capture(self, batch: int, shape: PrefillShape) -> _Graph:
        if self.on_capture is not None:
            self.on_capture()
        columns = id_columns(shape.rows, shape.chain, self.num_modules)
        inputs = torch.zeros(4 * batch + batch * columns, dtype=torch.int64, device=self.device)
        inputs[:batch] = self.state.pad_slot  # every row padding: warm-up and capture write no KV
        x = self._inputs(inputs, batch)
        graph, out = capture_graph(lambda: self.step(x, shape), self.pool, self.device)
        g = self.graphs[(batch, shape)] = _Graph(inputs, graph, out)
        return g


def finish_prefill(reqs: list[CachedRequest], lens: list[int], host: list[list[float]], num_modules: int,
                   logprob_rows: Callable[[CachedRequest, list[float]], list | None]) -> StepResult:
    """Advance the host's view of each request as the device did; the final chunks' tokens -> result."""
    result = StepResult()
    for r, n, row in zip(reqs, lens, host):
        s, verified = r.num_computed, len(r.token_ids)
        final = s + n == verified
        for m in range(min(r.num_spec, num_modules)):  # as PrefillStep._module_commit
            commit = verified - m if final else min(s + n, verified - m - 1)
            r.mtp_computed[m] = max(r.mtp_computed[m], commit)
        if not final:
            r.num_computed += n
            continue
        token = int(row[1])
        r.token_ids.append(token)
        r.num_computed = verified
        result.req_ids.append(r.req_id), result.num_accepted.append(0), result.token_ids.append([token])
        result.logprobs.append(logprob_rows(r, row))
    return result
