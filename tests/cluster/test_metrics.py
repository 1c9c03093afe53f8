"""Prometheus metrics of a real server (docs/design.md §7): a scrape after traffic parses, follows the naming
rules, and its counters agree with what the requests reported."""

from __future__ import annotations

import asyncio
import shutil
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtpserve.cluster.client import AsyncClient, Client, Generation
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.serve import ServerOptions, ServerThread, load_engine
from mtpserve.cluster.stats import SpecCounters
from tests.checkpoints import write_tokenizer
from tests.conftest import prompts_of

VOCAB = 64
Samples = dict[tuple[str, frozenset], float]
Traffic = tuple[Samples, list[Generation], str, Samples]  # final scrape, outputs, its text, mid-run scrape


@pytest.fixture(scope="module")
def ckpt(trained_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("metrics_ckpt") / "tiny-mtp"
    shutil.copytree(trained_ckpt, path)
    write_tokenizer(path, VOCAB)
    return path


def start(ckpt: Path, **engine_args: Any) -> ServerThread:
    engine = load_engine(EngineConfig(model=str(ckpt), num_speculative_tokens=3, **engine_args))
    return ServerThread(engine, ServerOptions(host="127.0.0.1", port=0, metrics_port=0))


def scrape_text(server: ServerThread) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(k[1])[label]: v for k, v in samples.items() if k[0] == name}


@pytest.fixture(scope="module")
def traffic(ckpt: Path) -> Iterator[Traffic]:
    """Serve a mix of requests (length, stop, abort, no speculation, invalid), then scrape; also scrape
    once while the request to be aborted is running."""
    server = start(ckpt, num_kv_blocks=400)
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
            outs = [c.generate(p, {"max_tokens": 20, "temperature": 0, "ignore_eos": True})
                    for p in prompts_of(VOCAB, [3, 8, 13, 21, 5, 30], seed=5)]
            stop_at = outs[0].token_ids[6]
            outs.append(c.generate(prompts_of(VOCAB, [3], seed=5)[0],
                                   {"max_tokens": 20, "temperature": 0, "stop_token_ids": [stop_at]}))
            outs.append(c.generate("w7 w8 w9", {"max_tokens": 9, "temperature": 0.8, "seed": 1, "ignore_eos": True,
                                                "num_speculative_tokens": 0}))
            stream = c.stream([4, 5, 6], {"max_tokens": 400, "temperature": 0, "ignore_eos": True},
                              request_id="aborted")
            aborted = Generation()
            aborted.add(next(stream))
            during = parse(scrape_text(server))
            assert c.abort("aborted")
            for delta in stream:
                aborted.add(delta)
            outs.append(aborted)
            with pytest.raises(Exception):
                c.generate([5], {"top_p": 0.0})  # refused: counted nowhere
        text = scrape_text(server)
        yield parse(text), outs, text, during
    finally:
        server.stop()


def test_scrape_follows_the_naming_rules(traffic: Traffic) -> None:
    _, _, text, _ = traffic
    families = list(text_string_to_metric_families(text))
    assert families and all(f.name.startswith("mtpserve_") for f in families)
    for f in families:
        names = {s.name for s in f.samples}
        if f.type == "counter":
            assert f"{f.name}_total" in names, f.name
        if f.type == "histogram" and any(w in f.name for w in ("time", "latency", "duration")):
            assert f.name.endswith("_seconds"), f.name


def test_request_counters_agree_with_the_requests(traffic: Traffic) -> None:
    s, outs, _, _ = traffic
    reasons = [o.finish_reason for o in outs]
    assert reasons.count("stop") == 1 and reasons.count("abort") == 1 and reasons.count("length") == 7
    for reason in ("stop", "length", "abort"):
        assert value(s, "mtpserve_request_success_total", finish_reason=reason) == reasons.count(reason)
    completion = [o.usage.completion_tokens for o in outs]
    assert completion == [len(o.token_ids) for o in outs]
    assert value(s, "mtpserve_generation_tokens_total") == sum(completion)
    assert value(s, "mtpserve_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert value(s, "mtpserve_prefill_tokens_total") == sum(o.usage.prompt_tokens for o in outs)  # no preemption
    assert value(s, "mtpserve_num_preemptions_total") == 0
    assert value(s, "mtpserve_time_to_first_token_seconds_count") == len(outs)
    assert value(s, "mtpserve_request_queue_time_seconds_count") == len(outs)
    assert value(s, "mtpserve_e2e_request_latency_seconds_count") == len(outs)
    assert value(s, "mtpserve_inter_token_latency_seconds_count") == sum(n - 1 for n in completion)
    for name in ("time_to_first_token", "e2e_request_latency", "inter_token_latency"):
        assert value(s, f"mtpserve_{name}_seconds_sum") > 0


def test_speculation_counters_agree_with_the_usage(traffic: Traffic) -> None:
    s, outs, _, _ = traffic
    accepted, steps = sum(o.usage.accepted_draft_tokens for o in outs), sum(o.usage.steps for o in outs)
    assert accepted > 0 and steps > 0
    assert value(s, "mtpserve_spec_decode_num_accepted_tokens_total") == accepted
    assert value(s, "mtpserve_spec_decode_num_drafts_total") == steps
    assert value(s, "mtpserve_spec_decode_acceptance_length_count") == steps
    assert value(s, "mtpserve_spec_decode_acceptance_length_sum") == accepted + steps
    draft_tokens = value(s, "mtpserve_spec_decode_num_draft_tokens_total")
    assert accepted <= draft_tokens <= 3 * steps
    per_pos_accepted = series(s, "mtpserve_spec_decode_num_accepted_tokens_per_pos_total", "position")
    per_pos_drafted = series(s, "mtpserve_spec_decode_num_draft_tokens_per_pos_total", "position")
    assert sum(per_pos_accepted.values()) == accepted and sum(per_pos_drafted.values()) == draft_tokens
    assert per_pos_drafted["0"] == steps  # every verification step verifies a draft at position 0
    drafted = [per_pos_drafted[str(j)] for j in range(8)]
    assert drafted == sorted(drafted, reverse=True) and drafted[3] == 0  # k = 3: positions 0..2 only
    modules = series(s, "mtpserve_spec_decode_num_draft_tokens_per_pos_total", "module")
    assert set(modules) == {"0", "1", "2"}  # depth chain: module k drafts position k, the last one the rest


def test_engine_gauges_and_step_histograms(traffic: Traffic) -> None:
    s, _, _, during = traffic
    assert value(during, "mtpserve_num_requests_running") == 1
    assert all(0 < u < 1 for u in series(during, "mtpserve_kv_cache_usage_ratio", "group").values())
    assert value(s, "mtpserve_num_requests_running") == 0 and value(s, "mtpserve_num_requests_waiting") == 0
    assert series(s, "mtpserve_kv_cache_usage_ratio", "group") == {"target": 0, "mtp0": 0, "mtp1": 0, "mtp2": 0}
    steps = value(s, "mtpserve_batch_size_count")
    assert steps > 0
    for phase in ("schedule", "target", "draft"):
        assert value(s, "mtpserve_step_duration_seconds_count", phase=phase) == steps
    assert value(s, "mtpserve_step_duration_seconds_sum", phase="target") > 0


def test_preemptions(ckpt: Path) -> None:
    """A KV pool too small for the batch preempts; the counter agrees with the scheduler, and recomputed
    prompt tokens show in prefill_tokens_total but not in prompt_tokens_total (prefix caching off: it
    would serve most of a recomputed prompt from the blocks the request itself left cached)."""
    server = start(ckpt, num_kv_blocks=24, block_size=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    try:
        prompts = prompts_of(VOCAB, [20, 24, 28, 31, 17, 26], seed=2)

        async def run() -> list[Generation]:
            async with AsyncClient(f"127.0.0.1:{server.port}", timeout=120) as c:
                return await asyncio.gather(*(c.generate(p, {"max_tokens": 24, "temperature": 0, "ignore_eos": True})
                                              for p in prompts))

        outs = asyncio.run(run())
        s = parse(scrape_text(server))
        preemptions = server.replica.engine_loop.call(lambda e: e.scheduler.num_preemptions).result(10)
        assert preemptions > 0 and value(s, "mtpserve_num_preemptions_total") == preemptions
        assert value(s, "mtpserve_prompt_tokens_total") == sum(len(p) for p in prompts)
        assert value(s, "mtpserve_prefill_tokens_total") > sum(len(p) for p in prompts)
        assert value(s, "mtpserve_generation_tokens_total") == sum(len(o.token_ids) for o in outs) == 24 * 6
    finally:
        server.stop()


def test_prefix_cache_counters(ckpt: Path) -> None:
    """Queries and hits per KV group: a second request sharing 2 blocks + 3 tokens with the first is served
    2 blocks (8 tokens) from the cache in every group; prefill_tokens_total counts only what was computed."""
    server = start(ckpt, block_size=4)
    try:
        first, second = prompts_of(VOCAB, [14, 6], seed=3)
        second = first[:11] + second
        with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
            for prompt in (first, second):
                c.generate(prompt, {"max_tokens": 5, "temperature": 0, "ignore_eos": True})
        s = parse(scrape_text(server))
        groups = ("target", "mtp0", "mtp1", "mtp2")
        assert series(s, "mtpserve_prefix_cache_queries_total", "group") == {g: len(first) + len(second) for g in groups}
        assert series(s, "mtpserve_prefix_cache_hits_total", "group") == {g: 8 for g in groups}
        assert value(s, "mtpserve_prefill_tokens_total") == len(first) + len(second) - 8
    finally:
        server.stop()


def test_spec_counters_count_each_position_a_step_verified() -> None:
    """A step's verifications counted per distinct draft count equal counting draft by draft."""
    drafts, accepted = [3, 0, 3, 1, 4, 3], [1, 0, 3, 0, 2, 1]
    counters = SpecCounters()
    counters.record(drafts, accepted)
    counters.record([2], [2])
    expected_drafted, expected_accepted = [0] * 8, [0] * 8
    for d, a in zip(drafts + [2], accepted + [2]):
        for j in range(d):
            expected_drafted[j] += 1
            expected_accepted[j] += j < a
    assert counters.drafted_per_position == expected_drafted and counters.accepted_per_position == expected_accepted
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (6, 16, 9)
