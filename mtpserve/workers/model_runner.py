"""Executes one StepPlan: target forward over the flat batch, verification, then the MTP drafter.

Uniform steps (every request at its frontier) run device-resident at fixed shapes, as one CUDA graph
on a GPU (mtpserve/workers/uniform_step.py, docs/design.md §8). Other steps (prefill chunks mixed in)
run the general path: host-planned layouts, the target eagerly, then the host-planned drafter.
Either way the step's one device-to-host copy is its packed result.

With a drafter group (docs/design.md §2) the chain runs in other processes, behind a `RemoteDrafts`
link: a uniform step (graphed on a GPU, without its chain) hands the group its packed result and the
rows module 0 reads, a general step its emitted tokens and hidden states, and `finish_step` takes the
group's drafts back into the slots. Prompt chunks then take the general path (no prefill steps here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import numpy as np
import torch

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.batch import build_metadata
from mtpserve.workers.cuda_graphs import TargetGraphs
from mtpserve.workers.device import Staging, to_device
from mtpserve.workers.drafter import Drafter, TargetRows
from mtpserve.workers.kv_cache import KVPools
from mtpserve.workers.packed_result import logprob_dicts, result_from_rows, top_logprobs
from mtpserve.workers.prefill_graphs import PrefillGraphs, finish_prefill
from mtpserve.workers.prefill_step import PrefillStep
from mtpserve.workers.models.loader import LoadedModel
from mtpserve.workers.rejection import verify_seeded
from mtpserve.workers.sampling import apply_penalties, argmax_rows, logprobs_topn, to_probs
from mtpserve.workers.slot_state import SamplingFlags, StateDiffs, device_state
from mtpserve.workers.state import (CachedRequest, SlotBuffers, StepLayout, apply_plan, at_frontier, record_emitted,
                                    sampling_tensors, subset)
from mtpserve.workers.uniform_batch import UniformBatch, UniformBatches
from mtpserve.workers.uniform_graphs import UniformGraphs
from mtpserve.workers.uniform_step import StepShape, UniformStep


@dataclass(frozen=True)
class RunnerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    num_mtp_modules: int  # modules in use (<= the checkpoint's)
    chain_mode: str
    draft_top_m: int
    cuda_graphs: bool = True  # decode/verify target forwards replay CUDA graphs (only on CUDA devices)
    max_model_len: int | None = None  # fixes the graphs' block-table width; None = the model's max_position
    uniform_steps: bool = True  # device-resident fixed-shape steps where every request is at its frontier
    pad_uniform_steps: bool | None = None  # pad uniform steps to batch buckets; None = only with CUDA graphs
    # Numbers of drafts whose uniform-step graphs (greedy and plain sampling) are captured for every batch
    # bucket when the runner starts, so that the first requests do not wait on compiles and captures.
    capture_at_start: tuple[int, ...] = ()
    # Prompt chunks whose modules are aligned run as fixed-shape prefill steps (graphed on CUDA) while the
    # padded step holds at most this many rows; 0 sends every chunk through the general path.
    prefill_step_rows: int = 0


class RemoteDrafts(Protocol):
    """The drafter group as the target ranks see it (mtpserve/workers/drafter_group.py)."""

    feeds: bool  # this rank sends the group its inputs (rank 0)

    def send(self, reqs: list[CachedRequest], lay: StepLayout, result: StepResult, rows: TargetRows) -> None: ...

    def send_uniform(self, packed: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor,
                     shape: StepShape) -> None: ...

    def receive(self, slots: SlotBuffers) -> None: ...


class ModelRunner:
    num_catch_ups = 0  # requests rewound so that lagging modules catch up (design §9; tests and profiles read it)

    def __init__(self, model: LoadedModel, config: RunnerConfig, dtype: torch.dtype, device: torch.device,
                 remote: RemoteDrafts | None = None) -> None:
        self.model, self.config, self.device, self.remote = model, config, device, remote
        cfg = model.config
        self.vocab = cfg.vocab_size
        local_modules = 0 if remote is not None else config.num_mtp_modules  # their KV lives with the drafters
        self.kv = KVPools.allocate(cfg, config.num_blocks, config.block_size, local_modules, dtype, device,
                                   num_kv_heads=model.target.layers[0].self_attn.num_kv_heads)
        self.slots = SlotBuffers(config.max_num_seqs, local_modules, cfg.hidden_size, self.vocab,
                                 config.draft_top_m, dtype, device)
        self.drafter = None if remote is not None else Drafter(
            model.mtp, model.target.embed_tokens, model.target.lm_head, self.kv.mtp, self.slots,
            config.block_size, config.chain_mode, config.draft_top_m, self.vocab)
        self.requests: dict[str, CachedRequest] = {}
        self.batches = UniformBatches(self.vocab)
        max_len = config.max_model_len or cfg.max_position
        graphs = config.cuda_graphs and device.type == "cuda"
        self.diffs: StateDiffs | None = None
        self.staging = Staging(device)  # the per-step copies both ways, through reused pinned buffers
        self.uniform: UniformGraphs | None = None
        self.prefill: PrefillGraphs | None = None
        self._device_slots: tuple[UniformBatch | None, torch.Tensor | None] = (None, None)
        if config.uniform_steps:
            state, self.diffs = device_state(config.max_num_seqs, 1 + local_modules, max_len, config.block_size,
                                             self.vocab, device)
            step = UniformStep(model, self.kv, self.slots, state, config.chain_mode, config.draft_top_m, local_modules,
                               handoff=remote is not None and remote.feeds)
            self.uniform = UniformGraphs(step, state, self.staging, config.max_num_seqs, device, graphs,
                                         config.pad_uniform_steps)
            if config.prefill_step_rows > 0 and remote is None:  # a prefill step runs the chain in process
                prefill = PrefillStep(model, self.kv, self.slots, state, step, local_modules, config.chain_mode)
                self.prefill = PrefillGraphs(prefill, state, self.staging, config.max_num_seqs, config.prefill_step_rows,
                                             local_modules, device, graphs)
        # Without uniform steps, graphs cover the target forward only.
        self.graphs = TargetGraphs(model.target, self.kv.target, config.max_num_seqs, config.block_size, max_len,
                                   device) if graphs and self.uniform is None else None
        self.num_captures = 0  # CUDA-graph captures so far (in the middle of serving: a shape seen first)
        self._capture_listeners: list[Callable[[], None]] = []
        for captured in (self.uniform, self.prefill, self.graphs):
            if captured is not None:
                captured.on_capture = self._capturing
        if self.uniform is not None and self.uniform.use_graphs:
            self.uniform.capture_all([StepShape(1 + k, k, SamplingFlags(all_greedy=greedy))
                                      for k in config.capture_at_start for greedy in (True, False)])
            if self.prefill is not None:
                self.prefill.capture_all(list(config.capture_at_start))

    @property
    def num_uniform_steps(self) -> int:
        """Steps whose uniform part ran (tests read it)."""
        return self.uniform.runs if self.uniform is not None else 0

    @property
    def num_graph_replays(self) -> int:
        """Uniform steps replayed from CUDA graphs (tests read it)."""
        return self.uniform.replays if self.uniform is not None else 0

    def on_capture(self, listener: Callable[[], None]) -> None:
        """Call `listener` before each CUDA-graph capture: a capture may compile kernels for seconds, and
        a worker tells its driver so (the step timeout must not take it for a hang)."""
        self._capture_listeners.append(listener)

    def _capturing(self) -> None:
        self.num_captures += 1  # the engine leaves a step whose time held a capture out of its step costs
        for listener in self._capture_listeners:
            listener()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        return self.wait(self.submit(plan))

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> "PendingStep | StepResult":
        """Launch a step: a uniform step returns at once with its result on the way to pinned host memory
        (the engine may plan and launch the next one meanwhile); any other step runs to its end here."""
        apply_plan(self.requests, self.slots, plan, self.config.num_mtp_modules, self.diffs)
        if plan.freed_ids or plan.new_requests:
            self.batches.forget()
        reqs = [self.requests[r] for r in plan.req_ids]
        if not reqs:
            return StepResult()
        plan = self._catch_up(reqs, plan)
        fast = self._at_frontier(reqs, plan)
        if all(fast):
            return self._launch_uniform(reqs, plan)
        # Prefill chunks joined: the requests at their frontier still take the uniform step, aligned
        # chunks a prefill step, and only the rest the general path (decode never waits on host planning).
        uniform = self._launch_uniform(*subset(reqs, plan, fast, True)) if any(fast) else None
        reqs, plan = subset(reqs, plan, fast, False)
        chunks = self.prefill.takes(reqs, plan) if self.prefill is not None else [False] * len(reqs)
        result = self._run_prefill(*subset(reqs, plan, chunks, True)) if any(chunks) else StepResult()
        if not all(chunks):
            result = _merged(result, self._run_general(*subset(reqs, plan, chunks, False)))
        return result if uniform is None else _merged(self.wait(uniform), result)

    def wait(self, handle: "PendingStep | StepResult") -> StepResult:
        return self._finish_uniform(handle) if isinstance(handle, PendingStep) else handle

    def _run_general(self, reqs: list[CachedRequest], plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        lay = StepLayout.of(reqs, plan)
        hidden = self._run_target(reqs, lay)
        result = self._verify(reqs, lay.final, hidden, lay.first_row + lay.n - 1, lay.d)
        lay.advance_unfinished(reqs)
        t1 = time.perf_counter()
        rows = TargetRows(self._hidden_for_mtp(hidden), lay.first_row, lay.starts)
        if self.remote is not None:
            self.remote.send(reqs, lay, result, rows)
        else:
            self.drafter.run(reqs, lay.final, rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # only for honest phase timing; the step ends here anyway
        result.target_seconds, result.draft_seconds = t1 - t0, time.perf_counter() - t1
        return result

    def _run_prefill(self, reqs: list[CachedRequest], plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        packed, raw = self.prefill.run(reqs, plan.num_tokens, self.diffs)
        host = self._to_host(reqs, packed, raw)  # the step's one wait
        result = finish_prefill(reqs, plan.num_tokens, host, self.config.num_mtp_modules,
                                lambda r, row: logprob_dicts(row, 0, 0, r.params.logprobs))
        result.target_seconds = time.perf_counter() - t0  # one graph: no phase split
        return result

    def _catch_up(self, reqs: list[CachedRequest], plan: StepPlan) -> StepPlan:
        """Rewind requests whose chain reaches a module that lagged (design §9: adaptive speculation ran
        fewer drafts for a while, so the modules past them stopped committing). Such a request feeds the
        target again from c, the lowest committed position of the modules its chain uses now, and those
        modules restart at c: the general path then recomputes the target rows (module 0's hidden input)
        and every module over the lag, exactly as a prefill chunk of verified tokens (§3's invariant)."""
        modules = self.config.num_mtp_modules
        if not modules or self.remote is not None:
            return plan
        lagging = [i for i, r in enumerate(reqs) if 0 < r.num_spec and _lags(r, min(r.num_spec, modules))]
        if not lagging:
            return plan
        self.num_catch_ups += len(lagging)
        num_tokens = list(plan.num_tokens)
        for i in lagging:
            r, used = reqs[i], min(reqs[i].num_spec, modules)
            c = min(r.mtp_computed[:used])
            r.mtp_computed[:used] = [c] * used
            num_tokens[i] += r.num_computed - c
            r.num_computed = c
        return replace(plan, num_tokens=num_tokens)  # the engine's plan stays as it made it

    def _at_frontier(self, reqs: list[CachedRequest], plan: StepPlan) -> list[bool]:
        if self.uniform is None:
            return [False] * len(reqs)
        return at_frontier(reqs, plan, self.config.num_mtp_modules)

    def _launch_uniform(self, reqs: list[CachedRequest], plan: StepPlan) -> "PendingStep":
        t0 = time.perf_counter()
        batch = self.batches.of(reqs, plan.req_ids)
        shape = StepShape.of(reqs, plan, batch.flags, self.config.num_mtp_modules)
        packed, raw = self.uniform.run(batch.slots, np.asarray(plan.num_drafts, dtype=np.int64), shape, self.diffs)
        host, done = self._stage(packed, raw, batch.top_logprobs)
        if self.remote is not None:  # the group drafts from this step's result (sent outside any graph)
            # After the result's copy: an NCCL send holds the stream until the drafter rank posts its receive, and
            # the driver need not wait for that (two H200s: the group ran at 0.06-0.44 of in-process with the
            # copy queued behind the sends).
            rows = self.uniform.step.handed_off(len(reqs), shape.window) if self.remote.feeds else None
            self.remote.send_uniform(packed, rows, self._slots_on_device(batch), shape)
        return PendingStep(reqs, shape.window - 1, host, done, t0, self.uniform.began)

    def _slots_on_device(self, batch: UniformBatch) -> torch.Tensor:
        """The batch's slots as a device tensor (where the group's drafts go), copied only when the batch changed."""
        if self._device_slots[0] is not batch:
            self._device_slots = (batch, to_device(batch.slots, torch.long, self.device))
        return self._device_slots[1]

    def _finish_uniform(self, p: "PendingStep") -> StepResult:
        """Read a uniform step's result (the step's one wait for the device) and advance the host state."""
        device_seconds, blocked, modules = 0.0, 0.0, self.config.num_mtp_modules
        if p.done is not None:
            t0 = time.perf_counter()
            p.done.synchronize()
            blocked = time.perf_counter() - t0
            # From the GPU reaching this step's forward (the step before it done, or its launch) to its result
            # copied.
            device_seconds = p.begun.elapsed_time(p.done) / 1e3
        result = result_from_rows(p.reqs, p.host.tolist(), p.k)
        for r, tokens in zip(p.reqs, result.token_ids):
            r.token_ids += tokens
            n = r.num_computed = len(r.token_ids) - 1
            # The modules the chain ran for this request (n - m > 0: a uniform step's request is past the first
            # `modules` positions); or fewer, when a step launched meanwhile lowered its num_spec (design §9): a
            # module counted short is only caught up from a little further back.
            used = min(r.num_spec, modules)
            r.mtp_computed[:used] = range(n, n - used, -1)
        result.device_seconds, result.blocked_seconds = device_seconds, blocked
        result.target_seconds = time.perf_counter() - p.started  # one graph: no phase split
        return result

    @torch.inference_mode()
    def finish_step(self) -> None:
        """Take in the drafts the drafter group sampled (called once the result is on its way back)."""
        if self.remote is not None:
            self.remote.receive(self.slots)

    def _run_target(self, reqs: list[CachedRequest], lay: StepLayout) -> torch.Tensor:
        """Target forward over verified chunks plus draft windows -> pre-norm hidden [T, H]."""
        starts, n, d, first_row = lay.starts, lay.n, lay.d, lay.first_row
        hidden = self.graphs.run(reqs, starts, n, d, self.slots.draft_tokens) if self.graphs is not None else None
        if hidden is not None:  # a uniform decode/verify step replayed a graph
            return hidden
        positions, meta = build_metadata(starts, n + d, [r.block_ids[0] for r in reqs], self.config.block_size,
                                         self.device)
        host: list[int] = []
        for r, s, k, dd in zip(reqs, starts.tolist(), n.tolist(), d.tolist()):
            host += r.token_ids[s : s + k] + [0] * dd
        input_ids = to_device(host, torch.long, self.device)
        if d.any():  # drafts never left the device: gather them into their rows
            req_rep = np.repeat(np.arange(len(reqs)), d)
            j = np.arange(d.sum()) - np.repeat(np.cumsum(d) - d, d)
            rows = to_device(first_row[req_rep] + n[req_rep] + j, torch.long, self.device)
            slots = to_device([reqs[i].slot for i in req_rep], torch.long, self.device)
            input_ids[rows] = self.slots.draft_tokens[slots, to_device(j, torch.long, self.device)]
        return self.model.target(input_ids, positions, meta, self.kv.target)

    def _verify(self, reqs: list[CachedRequest], final: list[bool], hidden: torch.Tensor, window_row: np.ndarray,
                d: np.ndarray) -> StepResult:
        """Rejection-sample every request that reached its frontier; update its tokens on the host."""
        f_idx = [i for i, is_final in enumerate(final) if is_final]
        if not f_idx:
            return StepResult()
        f_reqs, dev = [reqs[i] for i in f_idx], self.device
        num_drafts = to_device(d[f_idx], torch.long, dev)
        k = int(d[f_idx].max())
        win = np.minimum(window_row[f_idx][:, None] + np.arange(k + 1), window_row[f_idx][:, None] + d[f_idx][:, None])
        raw = self.model.target.logits(hidden[to_device(win.reshape(-1), torch.long, dev)])  # [F*(K+1), V]
        st = sampling_tensors(f_reqs, self.vocab, dev)
        slots = to_device([r.slot for r in f_reqs], torch.long, dev)
        draft_ids = self.slots.draft_tokens[slots, :k]
        logits = self._penalised(raw, st, slots, draft_ids, k) if st.use_penalties else raw
        probs = to_probs(logits.view(len(f_reqs), k + 1, -1), st)  # per-request settings over each window
        frontier = to_device([len(r.token_ids) for r in f_reqs], torch.long, dev)
        tokens, accepted = verify_seeded(
            probs, argmax_rows(logits).view(len(f_reqs), k + 1), draft_ids, self.slots.q_ids[slots, :k],
            self.slots.q_probs[slots, :k], num_drafts, st.greedy, st.seed, frontier)
        _force_resumed(f_reqs, tokens)
        host = self._to_host(f_reqs, torch.cat((accepted[:, None], tokens), dim=1), raw)  # the step's one sync
        result = result_from_rows(f_reqs, host, k)
        record_emitted(f_reqs, result.token_ids, self.slots, self.diffs)  # the device-resident state follows
        return result

    def _to_host(self, reqs: list[CachedRequest], packed: torch.Tensor, raw: torch.Tensor) -> list[list[float]]:
        host, done = self._stage(packed, raw, top_logprobs(reqs))
        if done is not None:
            done.synchronize()
        return host.tolist()

    def _stage(self, packed: torch.Tensor, raw: torch.Tensor, top_n: int | None
               ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The step's one device-to-host copy, started: per request [a, tokens (K+1), logprobs if asked].

        packed [R, 1 + (K+1)]: accepted count, then tokens. Logprobs are of the raw model distribution,
        for every window position: chosen [K+1], then top-n ids and values [(K+1) * n]; with them
        everything travels as float64, exact for token ids. On CUDA the copy lands in pinned memory
        and the returned event marks its end; the device buffers may then be reused at once.
        """
        if top_n is not None:
            lp, ids, vals = logprobs_topn(raw, packed[:, 1:].reshape(-1), top_n)
            packed = torch.cat([packed.double()] + [t.reshape(len(packed), -1).double() for t in (lp, ids, vals)], 1)
        return self.staging.download(packed)

    def _penalised(self, raw: torch.Tensor, st, slots: torch.Tensor, draft_ids: torch.Tensor, k: int) -> torch.Tensor:
        """Penalties at window position j see the drafts before j, as they would see accepted tokens."""
        counts, prompt_mask = self.slots.penalty_state(slots)  # [F, V]
        drafted = torch.zeros(len(slots), k + 1, self.vocab, device=self.device)
        drafted[:, 1:].scatter_add_(2, draft_ids[..., None], torch.ones_like(draft_ids[..., None], dtype=torch.float))
        window_counts = counts[:, None] + drafted.cumsum(dim=1)
        rows = torch.arange(len(slots), device=self.device).repeat_interleave(k + 1)
        return apply_penalties(raw, window_counts.view(-1, self.vocab), prompt_mask[rows], st.take(rows))

    def _hidden_for_mtp(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.model.config.mtp.hidden_pre_norm or len(self.model.mtp) == 0:
            return hidden
        return self.model.target.norm(hidden)


def _lags(r: CachedRequest, used: int) -> bool:
    """Whether a module in 0..used-1 has committed less than it is due: min(num_computed, N - m - 1).

    A module runs only in steps where every lower one runs, so the highest lags whenever any does, except
    in the first `used` positions, where its due position is clamped at 0: there all are checked."""
    n, c = len(r.token_ids), r.num_computed
    if n > used:
        return r.mtp_computed[used - 1] < min(c, n - used)
    return any(r.mtp_computed[m] < min(c, n - m - 1) for m in range(used))


def _force_resumed(reqs: list[CachedRequest], tokens: torch.Tensor) -> None:
    """A resumed request's prefill emits the token it had already produced (it verifies no drafts, so
    column 0 is its one token); its drafts then come from the same inputs as in an undisturbed run."""
    forced = [(i, r.forced_token) for i, r in enumerate(reqs) if r.forced_token is not None]
    if forced:  # rare (after preemption or recovery): one small host-to-device copy
        rows, values = zip(*forced)
        tokens[list(rows), 0] = torch.tensor(values, dtype=tokens.dtype, device=tokens.device)


def _merged(a: StepResult, b: StepResult) -> StepResult:
    return StepResult(a.req_ids + b.req_ids, a.token_ids + b.token_ids, a.num_accepted + b.num_accepted,
                      a.logprobs + b.logprobs, a.target_seconds + b.target_seconds, a.draft_seconds + b.draft_seconds,
                      a.device_seconds + b.device_seconds, a.blocked_seconds + b.blocked_seconds)


@dataclass
class PendingStep:
    """A launched uniform step whose result is on its way to the host."""

    reqs: list[CachedRequest]
    k: int  # window - 1
    host: torch.Tensor  # the packed result (pinned on CUDA)
    done: torch.cuda.Event | None  # recorded after the copy (None off CUDA: already there)
    started: float
    begun: torch.cuda.Event | None = None  # recorded before the step's forward (None off CUDA)
    overlappable: bool = True  # a decode step: the engine may launch the next one before reading this
