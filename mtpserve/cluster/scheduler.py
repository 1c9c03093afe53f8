"""Continuous-batching scheduler: chunked prefill under a token budget, speculative verify windows,
KV blocks for every group, and preemption (by recomputation) of the newest running request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

import numpy as np

from mtpserve.cluster.block_manager import KVBlockManager
from mtpserve.cluster.module_lags import ModuleLags
from mtpserve.cluster.request import Request, Status
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.boundary.messages import NewRequest, StepPlan, StepResult
from mtpserve.workers.chain import extra_positions


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_mtp_modules: int
    chain_mode: str
    # While requests decode, new ones wait up to this many steps to be prefilled together: a step with
    # prompt chunks runs synchronously and costs mostly per step (the prefill launch, the admissions' host
    # work, the broken overlap), so at high load admitting each arrival alone would turn most steps into
    # such steps. 0 admits every arrival at the next step.
    prefill_hold_steps: int = 0


class Scheduler:
    # A module that has lagged over more positions than this is not caught up: raising k to it would rewind the
    # request that far (design §9), a recomputation bigger than it can pay back.
    MAX_CATCH_UP = 256

    def __init__(self, config: SchedulerConfig, blocks: KVBlockManager, adaptive: AdaptiveSpec | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.adaptive = adaptive  # chooses each step's k for the requests that asked for "auto" (docs/design.md §9)
        self.step_k: int | None = None  # the k chosen for the step being planned (None: not adaptive)
        self._rows: np.ndarray | None = None  # the running requests' AdaptiveSpec rows (None: running changed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._freed: list[str] = []  # workers drop these at the next step
        self.num_preemptions = 0
        self.num_steps = 0  # steps planned (synchronous and overlapped)
        self._groups_of_k: dict[int, tuple[int, ...]] = {}
        self.lags = ModuleLags(config.num_mtp_modules)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        req.block_hashes = [[] for _ in self.blocks.pools]
        req.queued_at_step = self.num_steps
        self.waiting.append(req)

    def _admitting(self) -> bool:
        """Whether waiting requests may join now (see SchedulerConfig.prefill_hold_steps): at once when
        nothing decodes or when they are a quarter of the batch, else once the oldest has waited its hold.
        A full batch whose slots free up a few a step (a closed loop at c = 256) so fills them every `hold`
        steps, not every step: on the H100 at T = 1 and k = 4, steps with prompts, at 12-17 ms each against
        6-7 ms for a decode step, were a third of the steps and half the time while every free slot was
        filled at once."""
        hold = self.config.prefill_hold_steps
        if not self.waiting or hold == 0 or not any(r.num_computed >= r.num_prompt_tokens for r in self.running):
            return bool(self.waiting)
        free = self.config.max_num_seqs - len(self.running)
        return free > 0 and (len(self.waiting) >= max(1, len(self.running) // 4)
                             or self.num_steps - self.waiting[0].queued_at_step >= hold)

    def finish(self, req: Request, reason: str) -> None:
        """Finish (or abort) a request: release its blocks now; workers drop it next step."""
        if req.status == Status.FINISHED:
            return
        if req.status == Status.RUNNING:
            self._offer(req, final=True)  # blocks that filled since the last offer, due or not
            self.running.remove(req)
            self._rows = None
            self._freed.append(req.request_id)
            self._release_row(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req.request_id)
        req.status, req.finish_reason = Status.FINISHED, req.finish_reason or reason
        del self.requests[req.request_id]

    def schedule(self) -> StepPlan:
        self.num_steps += 1
        admitting = self._admitting()
        self._choose_k()
        plan = StepPlan(freed_ids=self._freed)
        self._freed = []
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        i = caught = 0  # caught: positions rewound so far (plain locals: this loop runs per request per step)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            spec, rewind = self._spec(req), 0
            # Catch-ups leave each request after them its own token: once one is in the step, drafts do too. (Whole
            # windows at the step's k, reserved instead, left no catch-up room with a budget of 16 and three requests.)
            if req.live_spec >= 0:  # modules lag
                spec, rewind = self.lags.catch_up(req, spec, budget - (len(self.running) - i - 1))
            n, d = self._chunk(req, budget - rewind - (len(self.running) - i - 1 if rewind or caught else 0), spec)
            new_blocks = self._grow(req, n, d, plan)
            if new_blocks is None:
                break  # `req` itself was the newest and got preempted
            self._add_to_plan(plan, req, n, d, new_blocks, spec)
            caught += rewind
            budget -= n + d + rewind
            i += 1
        plan.catch_up_tokens = caught
        # After a preemption, admitting new work would only evict it again.
        preempted = self.num_preemptions > preemptions_before
        while admitting and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not preempted:
            req = self.waiting[0]
            groups = self._groups(req)
            # A prefix-cache hit: every group the request uses starts past the cached blocks.
            req.num_computed = self.blocks.share_cached_prefix(req.request_id, req.token_ids, req.block_hashes, groups)
            spec = self._spec(req)
            n, d = self._chunk(req, budget, spec)
            if self.blocks.allocate(req.request_id, self._slots(req, n, d), keep_watermark=True) is None:
                self.blocks.free(req.request_id)
                req.num_computed = 0
                break
            self.blocks.count_admission(groups, len(req.token_ids), req.num_computed)
            self.waiting.popleft()
            self.running.append(req)
            self._rows = None
            req.status = Status.RUNNING
            if self.adaptive is not None:
                req.spec_row = self.adaptive.admit(req.num_spec, req.adaptive, req.params.greedy)
            plan.new_requests.append(self._new_request(req))
            self._add_to_plan(plan, req, n, d, [], spec)
            budget -= n + d
        return plan

    def schedule_overlapped(self, in_flight: StepPlan) -> StepPlan | None:
        """The next decode step, planned while `in_flight` still runs (async scheduling, docs/design.md §8).

        Only when that step was a decode step of every running request and no waiting request is due to
        join (SchedulerConfig.prefill_hold_steps): each request then verifies its new drafts, which are
        already on the device. Its accepted count is not known yet, so blocks are allocated for the worst
        case (every draft in flight accepted), and a request that might finish in flight, or whose drafts
        max_tokens might cut depending on it, sits this step out; in the plan after it, its state is the
        host's, as in a synchronous step. Requests that finished since carry on in the step in flight (their
        tokens are dropped) and are freed by this plan: the workers run steps in order, so nothing reuses
        their slots or blocks before that step is done.
        None: the engine drains first.
        """
        if self._admitting():
            return None
        drafts_in_flight = dict(zip(in_flight.req_ids, in_flight.num_drafts))
        made_in_flight = dict(zip(in_flight.req_ids, in_flight.num_spec))  # the drafts this plan verifies
        self._choose_k()
        wanted: list[tuple[Request, int, int, int]] = []  # (request, tokens it may emit in flight, drafts, spec)
        budget = self.config.max_num_batched_tokens
        for req in self.running:
            if len(req.token_ids) - req.num_computed != 1:
                return None  # still prefilling
            spec, drafts = self._spec(req), drafts_in_flight.get(req.request_id)
            if drafts is None:  # it sat the step in flight out: nothing of it is in flight
                ahead, made = 0, req.num_drafts
                if 0 <= req.live_spec < spec:  # k rises past lagging modules: the synchronous path rewinds
                    return None
            else:
                ahead, made = drafts + 1, made_in_flight.get(req.request_id, req.num_spec)  # tokens it may emit
                # k rises past modules that lagged: the workers find them from their host state, which the step
                # in flight has yet to advance.
                if self.lags.modules(spec) > self.lags.modules(made):
                    return None
            left = req.tokens_left - ahead  # at the worst: every draft in flight accepted
            # Near max_tokens a step verifies at most tokens_left - 1 drafts, which the count in flight decides:
            # the request sits this step out rather than verify fewer drafts than a synchronous step would,
            # since a seeded sample depends on how many drafts each step verifies (CUDA's overlapped steps
            # gave other seeded outputs than the CPU's synchronous ones).
            if (ahead and left - 1 < min(made, spec)) or left < 1 or budget < 1:
                continue
            d = max(0, min(made, spec, budget - 1, left - 1))
            wanted.append((req, ahead, d, spec))
            budget -= 1 + d
        grown = self._allocate_all([(req, 1 + ahead, d) for req, ahead, d, _ in wanted]) if wanted else None
        if grown is None:
            return None  # nothing to run, or the synchronous path may preempt
        plan = StepPlan(freed_ids=self._freed)
        self._freed = []
        for (req, _, d, spec), new_blocks in zip(wanted, grown):
            self._add_to_plan(plan, req, 1, d, new_blocks, spec)
        self.num_steps += 1
        return plan

    def update(self, plan: StepPlan, result: StepResult, clock: list[float] | None = None
               ) -> list[tuple[Request, list[int], int, int]]:
        """Advance the scheduled requests; returns (request, newly kept tokens, drafts verified, of them
        accepted) for those that sampled. Requests that finished or were aborted since the plan was made are
        skipped. clock: the time is appended to it before the first request and after each one returned (the host's
        price of a token, token_price.py); a request skipped or resumed adds no share of its own."""
        for req_id, n, spec in zip(plan.req_ids, plan.num_tokens, plan.num_spec):
            req = self.requests.get(req_id)
            if req is not None:
                req.num_computed += n
                self.lags.settle(req, spec)
                if req.num_computed < len(req.token_ids):  # mid-prompt; one that sampled is offered below
                    self._offer(req)
        drafts = dict(zip(plan.req_ids, plan.num_drafts))
        made = dict(zip(plan.req_ids, plan.num_spec))
        advanced, seen = [], []
        if clock is not None:
            clock.append(time.perf_counter())
        for req_id, tokens, accepted in zip(result.req_ids, result.token_ids, result.num_accepted):
            req = self.requests.get(req_id)
            if req is None or req.status != Status.RUNNING:
                _restart(clock)
                continue  # a stop found one step late: what was computed after it is dropped
            if req.resume_token is not None:  # the recomputed prefill emitted the held-back token again
                req.token_ids.append(req.resume_token)
                req.resume_token = None
                req.num_computed, req.num_drafts = len(req.token_ids) - 1, made.get(req_id, req.num_spec)
                self._offer(req)
                _restart(clock)
                continue
            kept = req.append_verified(tokens)
            # The last token is sampled but not yet fed to the target: it is input to the next step.
            req.num_computed = len(req.token_ids) - 1
            req.num_drafts = made.get(req_id, req.num_spec)
            if drafts[req_id] > 0:
                req.accepted_per_step.append(accepted)
                seen.append((req.spec_row, drafts[req_id], accepted))
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            advanced.append((req, tokens[:kept], drafts[req_id], accepted))
            self._offer(req)
            if req.finish_reason:
                self.finish(req, req.finish_reason)
            if clock is not None:
                clock.append(time.perf_counter())
        if self.adaptive is not None:
            self.adaptive.acceptance.observe_step(seen)
        return advanced

    def _choose_k(self) -> None:
        """Choose this step's k from the running requests' acceptance and the batch's step costs."""
        if self.adaptive is not None:
            if self._rows is None:  # gathered again only when the running set changed
                self._rows = np.fromiter((r.spec_row for r in self.running), dtype=np.int64, count=len(self.running))
            # Priced at the batch the decode will run at: the running requests and the waiting ones that join.
            batch = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
            newcomers_adaptive = bool(self.running) or any(r.adaptive for r in islice(self.waiting, batch))
            self.step_k = self.adaptive.choose(self._rows, batch, newcomers_adaptive)

    def _spec(self, req: Request) -> int:
        """Drafts the request's chain makes this step: for an adaptive request the step's k (at most its
        cap), prompt chunks included, so that a batch at k = 0 prefills as cheaply as without speculation;
        the modules a step leaves out lag, and the workers catch them up when k rises (design §9). Except
        while more than MAX_CATCH_UP tokens are still to compute and no module lags: a lag that long
        would never be caught up, so a long prompt runs its whole chain rather than never speculating."""
        if not req.adaptive or self.step_k is None:
            return req.num_spec
        k, cap = self.step_k, req.num_spec
        # Plain comparisons, no min(): this runs per request per step (at c = 128 the general form cost the
        # schedule 25 us a step on the CPU, beside 5 us for fixed-k requests).
        k = k if k < cap else cap
        live = req.live_spec
        if live < 0:
            return cap if len(req.token_ids) - req.num_computed > self.MAX_CATCH_UP else k
        return self.lags.within(req, k, self.MAX_CATCH_UP) if live < k else k

    def _release_row(self, req: Request) -> None:
        if self.adaptive is not None and req.spec_row >= 0:
            self.adaptive.release(req.spec_row)
            req.spec_row = -1

    def _chunk(self, req: Request, budget: int, spec: int) -> tuple[int, int]:
        """Tokens to compute and drafts to verify this step, within the token budget (spec: _spec(req))."""
        remaining = len(req.token_ids) - req.num_computed
        n = min(remaining, budget)
        if n < remaining:
            return n, 0
        if 0 <= req.live_spec < spec:
            # k rises past modules that lagged: the workers rewind this request (design §9). Without drafts to
            # verify, the recomputation is an aligned prompt chunk, which runs as a graphed prefill step (§8)
            # instead of a general-path pass; the drafts dropped are those of one step, once per rise.
            return n, 0
        # Drafts past what the request may still emit would only be thrown away.
        return n, max(0, min(req.num_drafts, spec, budget - n, req.tokens_left - 1))

    def _slots(self, req: Request, n: int, d: int, final: bool | None = None) -> list[int]:
        """Positions each KV group must cover this step (docs/design.md §5)."""
        end = req.num_computed + n + d
        final = req.num_computed + n == len(req.token_ids) if final is None else final
        extras = extra_positions(req.num_spec, self.config.num_mtp_modules, self.config.chain_mode)
        # A final step also drafts: module m then writes up to `extra` positions past the target's end. Every group
        # used is grown as far as the one that writes furthest, so that all cross block boundaries together: one
        # allocation per block instead of one per group boundary (at k = 4 over 3 modules they were staggered by one
        # position, and a capped request allocated 40 % more often than at k = 3 on the host).
        reach = end + max((0, *extras)) if final else end
        return [reach] + [reach if e >= 0 else 0 for e in extras]

    def _groups(self, req: Request) -> tuple[int, ...]:
        """The KV groups this request uses: the target, and the modules its chain reaches."""
        groups = self._groups_of_k.get(req.num_spec)
        if groups is None:
            extras = extra_positions(req.num_spec, self.config.num_mtp_modules, self.config.chain_mode)
            groups = self._groups_of_k[req.num_spec] = (0,) + tuple(1 + m for m, e in enumerate(extras) if e >= 0)
        return groups

    def _offer(self, req: Request, final: bool = False) -> None:
        """Newly committed full blocks become reusable (a no-op until a block fills). final: the request is
        finishing, and a block not yet due (the target's waits for the modules' lookahead) is offered now or
        never."""
        if req.status == Status.RUNNING and (final or self.blocks.offer_due(req.request_id, req.num_computed)):
            self.blocks.offer_committed(req.request_id, req.token_ids, req.num_computed, req.block_hashes,
                                        self._groups(req), req.modules_exact_upto, final)

    def _allocate(self, req: Request, n: int, d: int) -> list[list[int]] | None:
        """The blocks each group gains this step ([]: none, the usual decode step); None when some group lacks
        free blocks."""
        if req.num_computed + n + d <= req.kv_room:
            return []
        new_blocks = self.blocks.allocate(req.request_id, self._slots(req, n, d))
        if new_blocks is not None:
            req.kv_room = self._kv_room(req)
        return new_blocks

    def _allocate_all(self, wanted: list[tuple[Request, int, int]]) -> list[list[list[int]]] | None:
        """_allocate for each (request, tokens, drafts) of `wanted` as a final step, all or none (an overlapped
        plan that is dropped must not leave blocks behind that its workers never heard of)."""
        grow = [i for i, (req, n, d) in enumerate(wanted) if req.num_computed + n + d > req.kv_room]
        grown = self.blocks.allocate_all([(wanted[i][0].request_id, self._slots(*wanted[i], final=True)) for i in grow])
        if grown is None:
            return None
        out: list[list[list[int]]] = [[] for _ in wanted]
        for i, new_blocks in zip(grow, grown):
            out[i] = new_blocks
            wanted[i][0].kv_room = self._kv_room(wanted[i][0])
        return out

    def _kv_room(self, req: Request) -> int:
        """Request.kv_room from its block tables: module m's group must also hold the `extra` positions its
        drafts write past the end (_slots with final)."""
        tables, bs = self.blocks.tables[req.request_id], self.blocks.block_size
        extras = extra_positions(req.num_spec, self.config.num_mtp_modules, self.config.chain_mode)
        return min([len(tables[0]) * bs] + [len(t) * bs - e for t, e in zip(tables[1:], extras) if e >= 0])

    def _grow(self, req: Request, n: int, d: int, plan: StepPlan) -> list[list[int]] | None:
        while True:
            new_blocks = self._allocate(req, n, d)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is req:
                return None

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self._rows = None
        self._release_row(req)
        self.blocks.free(req.request_id)
        plan.freed_ids.append(req.request_id)
        if req.num_output_tokens and req.resume_token is None:
            # Hold the newest token back: the recomputing prefill ends by emitting it again (forced), and
            # drafts from it exactly as the step that produced it did, so seeded sampling is undisturbed.
            req.resume_token = req.token_ids.pop()
        req.status, req.num_computed, req.num_drafts, req.kv_room = Status.WAITING, 0, 0, -1
        req.modules_exact_upto, req.live_spec, req.lag_from = None, -1, None  # the prefill runs every module again
        req.catch_up_owed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def requeue_running(self) -> list[Request]:
        """After the workers were lost: every running request waits again to be recomputed, oldest
        first (they lost their KV with the workers); returns them."""
        lost = list(self.running)
        for req in reversed(lost):
            self._preempt(req, StepPlan())
        self._freed = []  # the new workers never saw these ids
        self.blocks.forget_cached()  # the prefix cache named KV that died with the workers
        return lost

    def _new_request(self, req: Request) -> NewRequest:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        return NewRequest(
            request_id=req.request_id,
            token_ids=list(req.token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            params=req.params,
            num_spec=req.num_spec,
            seed=req.seed,
            block_ids=[list(b) for b in self.blocks.tables[req.request_id]],
            resume_token=req.resume_token,
            num_computed=[req.num_computed if g in self._groups(req) else 0 for g in range(len(self.blocks.pools))],
        )

    def _add_to_plan(self, plan: StepPlan, req: Request, n: int, d: int, new_blocks: list[list[int]],
                     spec: int) -> None:
        self.lags.advance(req, spec)  # modules past spec stop here until caught up (§9)
        plan.req_ids.append(req.request_id)
        plan.num_tokens.append(n)
        plan.num_drafts.append(d)
        plan.new_block_ids.append(new_blocks)
        plan.num_spec.append(spec)


def _restart(clock: list[float] | None) -> None:
    """Scheduler.update's clock past a request it skipped or resumed: the next request's share starts now."""
    if clock is not None:
        clock[-1] = time.perf_counter()
