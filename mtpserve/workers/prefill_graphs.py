"""Runs prefill steps (mtpserve/workers/prefill_step.py): which chunks qualify, one pinned copy in, a
CUDA-graph replay per (row bucket, PrefillShape), one result out.

Per step the host sends one int64 buffer: per request entry its slot, chunk start, chunk length and
verified length, then the chunks' ids back to back, then each entry's tail (the verified tokens past
its chunk), then the state diffs since the last step. With graphs every step has all R = max_num_seqs
+ 1 entries (unused ones: the pad slot, L = 0; the last one owns the padding rows) and T = a row
bucket >= the chunks' total, as long as T stays within `max_rows` (larger prompts are compute-bound:
the eager general path costs them little extra, and graphs of large shapes would hold much memory).
Off CUDA the step runs eagerly at the batch's own size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.cuda_graphs import capture_graph, growing_buckets
from mtpserve.workers.device import Staging
from mtpserve.workers.prefill_step import PrefillInputs, PrefillShape, PrefillStep, tail_columns
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, StateDiffs, sampling_flags
from mtpserve.workers.state import CachedRequest

MIN_ROWS = 16


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """16, 32, 64, then 128, 192, 256, 384, 512, 768, ... below max_rows, then max_rows."""
    return growing_buckets((MIN_ROWS, 2 * MIN_ROWS, 4 * MIN_ROWS), max_rows)


@dataclass
class _Graph:
    inputs: torch.Tensor  # static int64 buffer: slots, starts, lens, verified [R each], ids [T], tails [R, W]
    graph: torch.cuda.CUDAGraph
    out: tuple[torch.Tensor, torch.Tensor]


class PrefillGraphs:
    def __init__(self, step: PrefillStep, state: DeviceState, staging: Staging, max_num_seqs: int, max_rows: int,
                 num_modules: int, device: torch.device, use_graphs: bool) -> None:
        self.step, self.state, self.staging, self.device, self.num_modules = step, state, staging, device, num_modules
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pad = self.use_graphs  # tests pad on CPU too, to check that padded rows change nothing
        self.entries = max_num_seqs + 1  # R with padding: every request, plus the owner of the padding rows
        # The padding rows' owner reads its block table up to T: T stays within a table's positions.
        self.buckets = row_buckets(max(min(max_rows, state.max_blocks * state.block_size), MIN_ROWS))
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[PrefillShape, _Graph] = {}
        self.runs = self.replays = 0
        self.on_capture: Callable[[], None] | None = None

    def takes(self, reqs: list[CachedRequest], plan: StepPlan) -> list[bool]:
        """Which requests' chunks a prefill step can run: no drafts, no forced token, every module of the
        chain committed exactly to the chunk's start, and all of them within the largest row bucket."""
        ok = [d == 0 and r.forced_token is None
              and all(c == r.num_computed for c in r.mtp_computed[: min(r.num_spec, self.num_modules)])
              for r, d in zip(reqs, plan.num_drafts)]
        rows = sum(n for n, o in zip(plan.num_tokens, ok) if o)
        return ok if rows and (not self.pad or rows <= self.buckets[-1]) else [False] * len(reqs)

    def run(self, reqs: list[CachedRequest], lens: list[int], diffs: StateDiffs) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch the step -> (packed [R, 2], raw logits [R, V]); valid until the next replay."""
        self.runs += 1
        chain = max(q.num_spec for q in reqs) if self.num_modules else 0
        total = sum(lens)
        rows = next(b for b in self.buckets if b >= total) if self.pad else total
        shape = PrefillShape(rows, chain, sampling_flags([q.params for q in reqs], self.state.vocab))
        entries = self.entries if self.pad else len(reqs)
        head = self._head(reqs, lens, entries, shape)
        host, counts = diffs.pack(head)
        packed = self.staging.upload(host)  # the step's one host-to-device copy
        self.state.apply(packed[len(head):], counts)
        if not self.use_graphs:
            out, raw = self.step(self._inputs(packed[: len(head)], entries, shape), shape)
        else:
            g = self.graphs.get(shape) or self._capture(shape)
            g.inputs.copy_(packed[: len(head)])
            g.graph.replay()
            out, raw = g.out
            self.replays += 1
        return out[: len(reqs)], raw[: len(reqs)]

    def capture_all(self, chains: list[int]) -> None:
        """Capture every row bucket's graph for each chain length, greedy and plain sampling (at start)."""
        for rows in self.buckets:
            for chain in chains:
                for greedy in (True, False):
                    shape = PrefillShape(rows, chain if self.num_modules else 0, SamplingFlags(all_greedy=greedy))
                    if shape not in self.graphs:
                        self._capture(shape)

    def _head(self, reqs: list[CachedRequest], lens: list[int], entries: int, shape: PrefillShape) -> np.ndarray:
        """slots, starts, lens, verified [entries each], ids [rows], tails [entries, columns]. Entries past
        the requests hold the pad slot; the last one owns the padding rows."""
        r, columns = len(reqs), tail_columns(shape.chain, self.num_modules)
        head = np.zeros(4 * entries + shape.tokens + entries * columns, dtype=np.int64)
        per_req = head[: 4 * entries].reshape(4, entries)
        per_req[0] = self.state.pad_slot
        per_req[:, :r] = [[q.slot for q in reqs], [q.num_computed for q in reqs], lens, [len(q.token_ids) for q in reqs]]
        per_req[2, -1] += shape.tokens - sum(lens)  # == 0 unless padded (then entries > r)
        ids, tails = head[4 * entries : 4 * entries + shape.tokens], head[4 * entries + shape.tokens :]
        tails = tails.reshape(entries, columns)
        at = 0
        for i, (q, n) in enumerate(zip(reqs, lens)):  # one slice per request: its chunk, then what follows it
            s = q.num_computed
            ids[at : at + n] = q.token_ids[s : s + n]
            after = q.token_ids[s + n : s + n + columns]
            tails[i, : len(after)] = after
            at += n
        return head

    def _inputs(self, buf: torch.Tensor, entries: int, shape: PrefillShape) -> PrefillInputs:
        slots, starts, lens, verified = buf[: 4 * entries].view(4, entries)
        ids = buf[4 * entries : 4 * entries + shape.tokens]
        tails = buf[4 * entries + shape.tokens :].view(entries, -1)
        return PrefillInputs(slots, starts, lens, verified, ids, tails)

    def _capture(self, shape: PrefillShape) -> _Graph:
        if self.on_capture is not None:
            self.on_capture()
        head = self._head([], [], self.entries, shape)  # every row padding: warm-up and capture write no KV
        inputs = torch.from_numpy(head).to(self.device)
        x = self._inputs(inputs, self.entries, shape)
        graph, out = capture_graph(lambda: self.step(x, shape), self.pool, self.device)
        g = self.graphs[shape] = _Graph(inputs, graph, out)
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
