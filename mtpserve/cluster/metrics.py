"""Prometheus metrics: the engine produces plain data (StepStats, RequestOutput); this logger turns it
into `mtpserve_*` metrics (vLLM v1 style), so the engine never imports prometheus_client.

Each server owns its own CollectorRegistry, so several servers (tests) can live in one process.
The logger is fed from the engine thread only; prometheus_client's metrics are thread-safe for the
scrape that reads them from the HTTP thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mtpserve.cluster.recovery import RecoveryEvent
from mtpserve.cluster.stats import StepStats
from mtpserve.outputs import RequestOutput
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS

FINISH_REASONS = ("stop", "length", "abort")
STEP_PHASES = ("schedule", "target", "draft")

# Latency buckets from 1 ms (a tiny model's step) to minutes (a long request on a loaded server).
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_STEP = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_ACCEPT_LEN = tuple(float(n) for n in range(1, MAX_SPECULATIVE_TOKENS + 2))
_CHOSEN_K = tuple(float(k) for k in range(MAX_SPECULATIVE_TOKENS + 1))


def kv_group_names(num_mtp_modules: int) -> list[str]:
    """Label values of the KV groups, in StepStats.kv_usage order: the target, then each MTP module."""
    return ["target"] + [f"mtp{k}" for k in range(num_mtp_modules)]


def drafting_module(position: int, num_mtp_modules: int, chain: str) -> int:
    """The MTP module that drafts draft position `position` (docs/design.md §3): in the depth chain module
    k drafts position k and the last module continues recursively; the recursive chain uses module 0."""
    return 0 if chain == "recursive" else min(position, max(num_mtp_modules - 1, 0))


@dataclass
class _Tracked:
    """What the logger remembers about a request between steps."""

    last_token_time: float | None = None
    steps_seen: int = 0  # verification steps already observed for the acceptance-length histogram


@dataclass
class PrometheusLogger:
    num_mtp_modules: int
    chain: str = "depth"
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        r = self.registry
        self.running = Gauge("mtpserve_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("mtpserve_num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("mtpserve_kv_cache_usage_ratio", "Fraction of KV blocks in use, per KV group "
                              "(target, mtp0, mtp1, ...).", ["group"], registry=r)
        self.prompt_tokens = Counter("mtpserve_prompt_tokens", "Prompt tokens of requests that produced "
                                     "their first token.", registry=r)
        self.prefill_tokens = Counter("mtpserve_prefill_tokens", "Prompt tokens computed (recomputation "
                                      "after preemption counts again).", registry=r)
        self.generation_tokens = Counter("mtpserve_generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter("mtpserve_request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=r)
        self.preemptions = Counter("mtpserve_num_preemptions", "Requests preempted (to be recomputed).",
                                   registry=r)
        self.prefix_queries = Counter("mtpserve_prefix_cache_queries", "Tokens of admitted requests looked "
                                      "up in the prefix cache, per KV group.", ["group"], registry=r)
        self.prefix_hits = Counter("mtpserve_prefix_cache_hits", "Tokens whose KV came from the prefix cache, "
                                   "per KV group.", ["group"], registry=r)
        self.ttft = Histogram("mtpserve_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("mtpserve_inter_token_latency_seconds", "Time per token after the first "
                             "(a step's gap shared by the tokens it emitted).", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("mtpserve_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY,
                             registry=r)
        self.queue_time = Histogram("mtpserve_request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=_LATENCY, registry=r)
        self.step_time = Histogram("mtpserve_step_duration_seconds", "Engine step time by phase.", ["phase"],
                                   buckets=_STEP, registry=r)
        self.batch_size = Histogram("mtpserve_batch_size", "Requests per engine step.", buckets=_BATCH,
                                    registry=r)
        self._spec_metrics(r)
        self._recovery_metrics(r)
        self._tracked: dict[str, _Tracked] = {}
        self._precreate_children()

    def _spec_metrics(self, r: CollectorRegistry) -> None:
        self.drafts = Counter("mtpserve_spec_decode_num_drafts", "Verification steps with at least one draft.",
                              registry=r)
        self.draft_tokens = Counter("mtpserve_spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter("mtpserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       registry=r)
        pos_labels = ["position", "module"]
        self.accepted_per_pos = Counter("mtpserve_spec_decode_num_accepted_tokens_per_pos", "Accepted drafts "
                                        "per draft position (and the MTP module drafting it).", pos_labels,
                                        registry=r)
        self.drafted_per_pos = Counter("mtpserve_spec_decode_num_draft_tokens_per_pos", "Verified drafts per "
                                       "draft position (and the MTP module drafting it).", pos_labels, registry=r)
        self.acceptance_length = Histogram("mtpserve_spec_decode_acceptance_length", "Tokens emitted per "
                                           "verification step (accepted drafts + 1).", buckets=_ACCEPT_LEN,
                                           registry=r)
        # Adaptive speculation (docs/design.md §9).
        self.chosen_k = Histogram("mtpserve_spec_decode_chosen_k", "Drafts per request chosen for each step by "
                                  "adaptive speculation (num_speculative_tokens=auto).", buckets=_CHOSEN_K,
                                  registry=r)
        self.acceptance_estimate = Gauge("mtpserve_spec_decode_acceptance_estimate", "Engine-wide estimate of "
                                         "the probability that a draft at this position is accepted, given the "
                                         "earlier ones were (the adaptive chooser's prior).", pos_labels,
                                         registry=r)

    def _recovery_metrics(self, r: CollectorRegistry) -> None:
        self.worker_restarts = Counter("mtpserve_worker_restarts", "Worker processes replaced after a worker "
                                       "fault (death, closed channel, failure or hung step).", registry=r)
        self.recovery_time = Histogram("mtpserve_recovery_seconds", "From noticing a worker fault to the "
                                       "replacement workers being ready.", buckets=_LATENCY, registry=r)
        self.requests_resumed = Counter("mtpserve_requests_resumed", "Running requests requeued (their KV "
                                        "recomputed) after a worker fault.", registry=r)

    def record_recovery(self, event: RecoveryEvent) -> None:
        self.worker_restarts.inc(event.workers_restarted)
        self.recovery_time.observe(event.seconds)
        self.requests_resumed.inc(event.requests_resumed)

    def _precreate_children(self) -> None:
        """Export every labelled series at 0 from the start, so dashboards and rate() see them."""
        for group in kv_group_names(self.num_mtp_modules):
            self.kv_usage.labels(group)
            self.prefix_queries.labels(group)
            self.prefix_hits.labels(group)
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        for phase in STEP_PHASES:
            self.step_time.labels(phase)
        if self.num_mtp_modules:
            for pos in range(MAX_SPECULATIVE_TOKENS):
                self._pos_labels(self.accepted_per_pos, pos)
                self._pos_labels(self.drafted_per_pos, pos)

    def _pos_labels(self, metric: Counter | Gauge, position: int) -> Counter | Gauge:
        return metric.labels(str(position), str(drafting_module(position, self.num_mtp_modules, self.chain)))

    # -- feeding ----------------------------------------------------------------------------------
    def record_step(self, stats: StepStats, outputs: list[RequestOutput], now: float | None = None) -> None:
        """One engine step: its StepStats and the RequestOutputs it returned."""
        now = time.monotonic() if now is None else now
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        for group, usage in zip(kv_group_names(self.num_mtp_modules), stats.kv_usage):
            self.kv_usage.labels(group).set(usage)
        for group, queries, hits in zip(kv_group_names(self.num_mtp_modules), stats.prefix_cache_queries,
                                        stats.prefix_cache_hits):
            self.prefix_queries.labels(group).inc(queries)
            self.prefix_hits.labels(group).inc(hits)
        self.prefill_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        if stats.batch_size:  # idle steps that only flush aborts would skew the step histograms
            self.batch_size.observe(stats.batch_size)
            for phase, seconds in zip(STEP_PHASES, (stats.schedule_seconds, stats.target_seconds,
                                                    stats.draft_seconds)):
                self.step_time.labels(phase).observe(seconds)
        self._record_spec(stats)
        for out in outputs:
            self._record_request(out, now)

    def _record_spec(self, stats: StepStats) -> None:
        spec = stats.spec
        self.drafts.inc(spec.num_drafts)
        self.draft_tokens.inc(spec.num_draft_tokens)
        self.accepted_tokens.inc(spec.num_accepted_tokens)
        for pos, (accepted, drafted) in enumerate(zip(spec.accepted_per_position, spec.drafted_per_position)):
            if drafted:
                self._pos_labels(self.accepted_per_pos, pos).inc(accepted)
                self._pos_labels(self.drafted_per_pos, pos).inc(drafted)
        if stats.spec_k is not None:
            self.chosen_k.observe(stats.spec_k)
        for pos, estimate in enumerate(stats.acceptance_estimate):
            self._pos_labels(self.acceptance_estimate, pos).set(estimate)

    def _record_request(self, out: RequestOutput, now: float) -> None:
        tracked = self._tracked.setdefault(out.request_id, _Tracked())
        n = len(out.new_token_ids)
        if n and tracked.last_token_time is None:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.first_token_time is not None:
                self.ttft.observe(out.first_token_time - out.arrival_time)
            if out.first_scheduled_time is not None:
                self.queue_time.observe(out.first_scheduled_time - out.arrival_time)
            n -= 1  # the first token has no inter-token gap
            tracked.last_token_time = out.first_token_time or now
        if n:
            gap = (now - tracked.last_token_time) / n
            for _ in range(n):  # one observation per token, so the count equals the tokens after the first
                self.itl.observe(gap)
            tracked.last_token_time = now
        for accepted in out.accepted_per_step[tracked.steps_seen:]:
            self.acceptance_length.observe(accepted + 1)
        tracked.steps_seen = len(out.accepted_per_step)
        if out.finished:
            self.success.labels(out.finish_reason).inc()
            self.e2e.observe((out.finished_time or now) - out.arrival_time)
            del self._tracked[out.request_id]
