"""The step-driven engine: add requests, step (schedule -> execute -> postprocess), abort, read outputs.

`LLM` wraps it for offline use and the gRPC router drives it for serving. Execution sits behind an
executor with one method, `execute(plan) -> result`: the in-process ModelRunner here, Ray workers
when the model is sharded or the drafter has GPUs of its own.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from mtpserve.cluster.block_manager import KVBlockManager
from mtpserve.cluster.engine_config import EngineConfig, ResolvedConfig
from mtpserve.cluster.output_processor import OutputProcessor
from mtpserve.cluster.recovery import FaultBudget, RecoveryEvent, recover
from mtpserve.cluster.request import Request
from mtpserve.cluster.scheduler import Scheduler, SchedulerConfig
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.spec_config import AdaptiveConfig
from mtpserve.cluster import warmup
from mtpserve.cluster.stats import SpecCounters, StepStats
from mtpserve.cluster.token_price import TokenPrice
from mtpserve.cluster.tokenizer import Tokenizer
from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.errors import InvalidRequestError, WorkerLost
from mtpserve.outputs import RequestOutput
from mtpserve.workers.heap import freeze_startup_heap
from mtpserve.sampling_params import SPEC_AUTO, SamplingParams


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def shutdown(self) -> None: ...


class AsyncExecutor(Executor, Protocol):
    """An executor that can launch a step and hand its result over later (`can_overlap`: in-process and Ray)."""

    can_overlap: bool

    def submit(self, plan: StepPlan) -> Any: ...  # a handle; handle.overlappable: a decode step in flight

    def wait(self, handle: Any) -> StepResult: ...


@dataclass
class _Step:
    """A launched step: its plan, the stats gathered while scheduling, and its result or handle."""

    plan: StepPlan
    stats: StepStats
    handle: Any  # a StepResult when it already ran, else the executor's handle
    overlapped: bool = False  # launched while the step before it was still in flight


class LLMEngine:
    # A lap whose chooser work (AdaptiveSpec.take_spent) exceeds this share of it teaches the step costs nothing.
    CHOOSER_SHARE = 0.02

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.resolved = ResolvedConfig.resolve(config)
        r = self.resolved
        self.model_config = r.model_config
        self.tokenizer = Tokenizer.from_checkpoint(r.model_path)
        self.executor = executor or r.make_executor()
        self.blocks = KVBlockManager(1 + r.num_mtp_modules, r.num_blocks, config.block_size,
                                     enable_caching=config.enable_prefix_caching)
        self.adaptive = (AdaptiveSpec(AdaptiveConfig(r.max_auto_spec, config.max_num_seqs, modules=r.num_mtp_modules))
                         if r.adaptive else None)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, r.num_mtp_modules, config.mtp_chain,
                            config.prefill_hold_steps),
            self.blocks, self.adaptive,
        )
        self._step_clock = _StepClock()
        self._captures_seen = 0  # the executor's graph captures when the last step cost was learned
        self._executor_seconds = [0.0, 0.0]  # since the last lap: inside submit / execute, blocked in wait
        for batch, k, greedy, seconds in getattr(self.executor, "start_step_costs", ()) if self.adaptive else ():
            if k <= r.max_auto_spec:
                self.adaptive.costs.seed(batch, k, seconds, greedy)
        self.outputs = OutputProcessor(self.tokenizer)
        self.spec = SpecCounters()
        self.last_stats = StepStats()
        self._aborted: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self._async = r.async_scheduling and getattr(self.executor, "can_overlap", False)
        self._in_flight: _Step | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous one's results were read
        self.faults = FaultBudget(config.max_faults, config.fault_window_s)
        self.recoveries: list[RecoveryEvent] = []  # recovered worker faults, for whoever reports them
        self.on_serving: Callable[[bool], None] | None = None  # told when a recovery starts and ends
        self.num_warmup_steps = 0  # synthetic steps run before serving (cluster/warmup.py), recoveries' included
        if warmup.wanted(r):
            try:
                self._warm_up()
            except BaseException:  # the workers, their GPUs and placement groups go with the failed start
                self.executor.shutdown()
                raise
        freeze_startup_heap()

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError naming the offending field."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"a request with id {request_id!r} is already running")
        token_ids = self._tokenize(prompt)
        r = self.resolved
        if params.max_tokens > r.max_model_len - len(token_ids):
            raise InvalidRequestError("max_tokens", f"{params.max_tokens} new tokens after a prompt of "
                                      f"{len(token_ids)} exceed the context of {r.max_model_len}")
        num_spec, adaptive = self._num_spec(params)
        req = Request(
            request_id, token_ids, len(token_ids), params, num_spec,
            params.seed if params.seed is not None else self._rng.getrandbits(63),
            () if params.ignore_eos else r.eos_token_ids, r.max_model_len, arrival_time or time.monotonic(),
            adaptive=adaptive,
        )
        self.scheduler.add(req)
        self.outputs.add(req)

    def _num_spec(self, params: SamplingParams) -> tuple[int, bool]:
        """(drafts per step or, adaptive, their upper bound; adaptive): the request's own setting, else the
        engine default. "auto" is adaptive where the replica can choose per step (design §9)."""
        r, spec = self.resolved, params.num_speculative_tokens
        if spec is None:
            spec = SPEC_AUTO if r.default_auto else r.default_num_spec
        if spec == SPEC_AUTO:
            return r.max_auto_spec, r.adaptive and r.max_auto_spec > 0
        if spec > 0 and r.num_mtp_modules == 0:
            raise InvalidRequestError("num_speculative_tokens", "this model has no MTP modules to draft with")
        return spec, False

    def abort_request(self, request_id: str) -> None:
        """Abort a waiting or running request; its KV is freed now and the workers drop it next step."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self._aborted.append(self.outputs.finish(req))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch a step and return the outputs of the last one that finished.

        With async scheduling the next decode step is launched before the host reads the results of
        the one in flight, so the device never waits for the host's postprocessing and scheduling.
        A lost worker is replaced and the running requests resume (mtpserve/cluster/recovery.py); past
        the fault budget this raises ReplicaFailed.
        """
        try:
            return self._step()
        except WorkerLost as e:
            self._in_flight = None  # its result is gone with the worker; the requeued requests redo it
            self.recoveries.append(recover(self.executor, lambda: len(self.scheduler.requeue_running()),
                                           self.faults, str(e), self.on_serving))
            if warmup.wanted(self.resolved):  # the new workers compile before they serve, as the first ones did
                self._warm_up()
            outputs, self._aborted = self._aborted, []
            return outputs

    def _step(self) -> list[RequestOutput]:
        if self._in_flight is None:
            self._in_flight = self._launch(self.scheduler.schedule)
        following = self._launch_overlapped()
        if self.adaptive is not None:  # the chooser's share of the next full choice, ahead of the wait (prepare_due)
            self.adaptive.prepare_due()
        done, self._in_flight = self._in_flight, following
        result = done.handle if isinstance(done.handle, StepResult) else self._timed(1, self.executor.wait, done.handle)
        # With async scheduling a lap is one step's period only inside an unbroken pipeline: a step launched
        # synchronously did its work inside the previous lap, and a lap after it can be a few microseconds.
        steady = not self._async or (done.overlapped and following is not None)
        return self._postprocess(done.plan, result, done.stats, steady)

    def _warm_up(self) -> None:
        """Synthetic prompts through every rank (cluster/warmup.py). A worker lost meanwhile is replaced within the
        fault budget, and the new workers warm up in turn (past the budget: ReplicaFailed)."""
        while True:
            try:
                self.num_warmup_steps += warmup.run(self.executor, self.resolved)
                return
            except WorkerLost as e:
                self.recoveries.append(recover(self.executor, lambda: 0, self.faults, f"warm-up: {e}",
                                               self.on_serving))

    def _timed(self, which: int, call: Callable[[Any], Any], arg: Any) -> Any:
        """call(arg), its seconds added to _executor_seconds[which] (0: launching, 1: waiting)."""
        t0 = time.perf_counter()
        out = call(arg)
        self._executor_seconds[which] += time.perf_counter() - t0
        return out

    def _launch(self, schedule) -> _Step:
        t0, preemptions = time.perf_counter(), self.scheduler.num_preemptions
        plan = schedule()
        stats = StepStats(schedule_seconds=time.perf_counter() - t0, num_prompt_tokens=self._prompt_tokens(plan),
                          num_preemptions=self.scheduler.num_preemptions - preemptions)
        stats.prefix_cache_queries, stats.prefix_cache_hits = self.blocks.take_counts()
        if not (plan.req_ids or plan.freed_ids):
            return _Step(plan, stats, StepResult())
        return _Step(plan, stats, self._timed(0, self.executor.submit if self._async else self.executor.execute, plan))

    def _launch_overlapped(self) -> _Step | None:
        """The next decode step, launched before the one in flight is read (None: run synchronously)."""
        current = self._in_flight
        if not self._async or not getattr(current.handle, "overlappable", False):
            return None
        step = self._launch(lambda: self.scheduler.schedule_overlapped(current.plan) or StepPlan())
        if not step.plan.req_ids:
            return None
        self.num_overlapped_steps += 1
        step.overlapped = True
        return step

    def _postprocess(self, plan: StepPlan, result: StepResult, stats: StepStats,
                     steady: bool = True) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        logprobs = dict(zip(result.req_ids, result.logprobs or [None] * len(result.req_ids)))
        price = self._token_price_timing(plan, stats)
        clock: list[float] | None = [] if price is not None else None
        advanced = self.scheduler.update(plan, result, clock)
        step_spec = SpecCounters()
        step_spec.record([d for _, _, d, _ in advanced], [a for _, _, _, a in advanced])
        self._emit(advanced, logprobs, outputs, clock, price)
        self.spec.add(step_spec)
        stats.num_running, stats.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        stats.kv_usage, stats.batch_size = self.blocks.usage(), len(plan.req_ids)
        stats.num_generation_tokens = sum(len(o.new_token_ids) for o in outputs)
        stats.spec = step_spec
        stats.target_seconds, stats.draft_seconds = result.target_seconds, result.draft_seconds
        self._learn_cost(plan, result, stats, steady)
        self.last_stats = stats
        return outputs

    def _token_price_timing(self, plan: StepPlan, stats: StepStats) -> TokenPrice | None:
        """The token price (token_price.py) where this step's postprocessing is to be timed request by request: one
        decode step in TokenPrice.EVERY. A request's first token (its prompt blocks offered) or a catch-up is work
        that its tokens do not price."""
        adaptive = self.adaptive
        if adaptive is None or not adaptive.config.token_price_within_steps or not _decodes_only(plan, stats):
            return None
        return adaptive.costs.tokens if adaptive.costs.tokens.due() else None

    def _emit(self, advanced: list[tuple[Request, list[int], int, int]], logprobs: dict[str, Any],
              outputs: list[RequestOutput], clock: list[float] | None, price: TokenPrice | None) -> None:
        """Each advanced request's output appended to `outputs` (finished ones finalised). clock: the scheduler's
        update timed request by request (None: this step is not timed); the output path is timed alike, and each
        request's two shares go to the token `price` against the tokens it kept, but for requests that finished (a
        finish frees and offers blocks, whatever the tokens)."""
        marks = [time.perf_counter()] if clock is not None else None
        for req, tokens, _, _ in advanced:
            out = self.outputs.process(req, tokens, logprobs[req.request_id])
            if req.finish_reason:
                self.scheduler.finish(req, req.finish_reason)
                out = self.outputs.finish(req)
            outputs.append(out)
            if marks is not None:
                marks.append(time.perf_counter())
        if clock is not None and marks is not None and price is not None:
            spent = [u1 - u0 + e1 - e0 for u0, u1, e0, e1 in zip(clock, clock[1:], marks, marks[1:])]
            kept = [(len(t), x) for (req, t, _, _), x in zip(advanced, spent) if not req.finish_reason]
            if kept:
                price.add(*zip(*kept))

    def _learn_cost(self, plan: StepPlan, result: StepResult, stats: StepStats, steady: bool) -> None:
        """Feed the step-cost model (design §9) and report the chosen k. A step's lap is the time since the
        previous step ended: with overlapped steps that is what the batch pays per step, host or device.
        Only decode steps at the same k as the one before count: a step with prompt chunks (or a catch-up
        after k rose) costs more than its k alone, and must not pollute the decode table. The lap is split
        into the device's share and the host's: overlapped on a device that timed the step, the host's is
        the lap less the time it sat blocked on the device (the rest of the executor's wait reads the result
        back, host work that grows with the batch: counted as waiting, it made host-bound laps at c = 256
        look device-bound); run serially, the device's is the time inside the executor."""
        k = max(plan.num_spec, default=0)
        seconds = self._step_clock.lap((k, _decodes_only(plan, stats)))
        (inside, waited), self._executor_seconds = self._executor_seconds, [0.0, 0.0]
        # A graph captured inside the lap (a shape first seen, e.g. the window after k fell) took it over.
        captures, self._captures_seen = self._captures_seen, getattr(self.executor, "num_captures", 0)
        if captures != self._captures_seen:
            seconds = None
        if self.adaptive is None:
            return
        if not _decodes_only(plan, stats):  # its neighbours' host shares are no probe's (StepCosts.interrupt)
            self.adaptive.costs.interrupt(bool(stats.num_prompt_tokens or plan.new_requests))
        chooser = self.adaptive.take_spent()  # the chooser's own host time in this lap (see take_spent)
        if not plan.req_ids:
            return
        stats.acceptance_estimate = self.adaptive.estimates()
        stats.spec_k = self.scheduler.step_k if self.adaptive.active else None  # None: no "auto" request ran
        # A lap in which the chooser worked for more than CHOOSER_SHARE of it is not learned from: that time costs
        # every k alike, is paced by the dwell, and would widen the host's spread of speeds (AdaptiveSpec.take_spent).
        if seconds is not None and steady and max(plan.num_drafts, default=0) == k \
                and chooser <= self.CHOOSER_SHARE * seconds:
            overlapped = self._async and result.device_seconds > 0
            device = result.device_seconds if overlapped else inside + waited
            host = seconds - (result.blocked_seconds if overlapped else inside + waited)
            tokens = sum(result.num_accepted) + len(result.num_accepted)
            # The batch's sampling mode as the chooser last saw it: the plan's own, except in the one step after
            # the running set changed mode (its sample lands in the other table, where the median ignores it).
            self.adaptive.costs.observe(len(plan.req_ids), k, device, max(host, 0.0), overlapped, tokens,
                                        self.adaptive.greedy, seconds)

    def _prompt_tokens(self, plan: StepPlan) -> int:
        """Prompt tokens this plan computes (recomputation after preemption counts again)."""
        reqs = (self.scheduler.requests[r] for r in plan.req_ids)
        return sum(max(0, min(r.num_computed + n, r.num_prompt_tokens) - r.num_computed)
                   for r, n in zip(reqs, plan.num_tokens))

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this checkpoint has no tokenizer.json: send token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.resolved.max_model_len:
            raise InvalidRequestError("prompt", f"the prompt has {len(token_ids)} tokens; the context is "
                                      f"{self.resolved.max_model_len}")
        return token_ids

    def shutdown(self) -> None:
        self.executor.shutdown()


def _decodes_only(plan: StepPlan, stats: StepStats) -> bool:
    """Whether a step only decoded: no prompt chunk, no request new to the workers, no catch-up."""
    return stats.num_prompt_tokens == 0 and not plan.new_requests and not plan.catch_up_tokens


class _StepClock:
    """Times consecutive decode steps of one kind: the lap since the previous step, when both were alike."""

    def __init__(self) -> None:
        self._last: tuple[float, tuple[int, bool]] | None = None

    def lap(self, kind: tuple[int, bool]) -> float | None:
        """kind: (the step's k, whether it only decoded); returns seconds when this and the last were both
        decode steps at the same k."""
        now, last = time.perf_counter(), self._last
        self._last = (now, kind)
        if last is None or not kind[1] or last[1] != kind:
            return None
        return now - last[0]
