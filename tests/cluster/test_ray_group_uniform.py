"""Drafter-group replicas take the device-resident uniform step (docs/design.md §2 and §8).

Target ranks run the uniform step without a chain and hand the group the packed result and module 0's
rows; drafter ranks commit the result to their own device state and run their modules' passes of the
same chain, handing it on between owners. Each layout must take uniform steps on every rank and give
the single-process engine's outputs token for token, acceptance for acceptance: greedy for k = 0..3,
seeded sampling (top-p; top-k with penalties and logprobs), requests preempted for want of KV blocks,
a request aborted mid-stream, and new requests in the slots of finished ones afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.workers.models.train import synthetic_tokens, tiny_config, train_tiny
from mtpserve.workers.models.writer import save_checkpoint
from tests.cluster.ray_helpers import assert_same_outputs, start_local_ray
from tests.conftest import prompts_of

pytestmark = pytest.mark.slow  # several processes (Ray workers), each importing torch

ENGINE = dict(block_size=4, max_num_batched_tokens=32, num_kv_blocks=40)  # short of blocks: preemptions
LENGTHS = [1, 2, 5, 8, 13, 17, 24, 31, 3, 9]


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def two_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two MTP modules, MiMo-style: module 0 reads the target's pre-norm rows, each module hands on its
    normed output (the other checkpoint covers the DeepSeek choices)."""
    cfg = {**tiny_config(vocab_size=64, num_mtp=2), "mtp_hidden_pre_norm": True, "mtp_pass_normed": True}
    target, mtp = train_tiny(synthetic_tokens(64, 20_000, seed=2, noise=0.3), cfg, steps=8, seed=1, seq_len=32,
                             batch_size=16, lr=1e-2)
    path = tmp_path_factory.mktemp("two_modules")
    save_checkpoint(path, cfg, target, mtp, dtype=torch.float32)
    return path


def _params(max_tokens: int = 14) -> list[SamplingParams]:
    greedy = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
              for k in (1, 2, 3) for _ in LENGTHS]
    sampled = [SamplingParams(max_tokens=max_tokens - i % 3, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True,
                              num_speculative_tokens=1 + i % 3) for i in range(len(LENGTHS))]
    penalised = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=20, repetition_penalty=1.3,
                                presence_penalty=0.4, frequency_penalty=0.2, seed=200 + i, ignore_eos=True,
                                num_speculative_tokens=3, logprobs=2) for i in range(len(LENGTHS))]
    # k = 0 too, last: once the batch holds no drafting request, a step sends the group nothing (drafter_group.py).
    plain = [SamplingParams(max_tokens=max_tokens + 4, temperature=0.0, ignore_eos=True, num_speculative_tokens=0)
             for _ in LENGTHS]
    return greedy + sampled + penalised + plain


def _streamed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Requests stepped by hand; the second is aborted after a few steps, mid-stream."""
    engine, done = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", prompt, p)
    for step in range(12):
        if step == 6:
            engine.abort_request("s1")
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[f"s{i}"] for i in range(len(prompts))]


def _workload(llm: LLM) -> list:
    """A mixed batch short of blocks, then a stream with an abort, then fresh requests in the freed slots."""
    prompts = prompts_of(64, LENGTHS, seed=11)
    outs = llm.generate(prompts * 6, _params())
    assert llm.engine.scheduler.num_preemptions > 0
    outs += _streamed(llm, prompts_of(64, [7, 12, 4, 20], seed=3), _params(24)[::12][:4])
    outs += llm.generate(prompts_of(64, [6, 15, 2, 11, 9], seed=4), _params(10)[::10][:5])
    assert llm.engine.blocks.all_free
    return outs


def _uniform_steps(llm: LLM) -> list[int]:
    """Each rank's count of steps whose uniform part it ran (asked over the control channels, between steps)."""
    counts = []
    for channel in llm.engine.executor._channels:
        channel.send(("counters", None))
        kind, counters = channel.recv()
        assert kind == "counters"
        counts.append(counters["uniform_steps"])
    return counts


LAYOUTS = {
    "tp1-G1-depth3": ("partly_trained", dict(drafter_devices=1)),
    # modules 0, 2 | 1; warmed up as on a GPU (cluster/warmup.py): every rank runs the synthetic prompts first
    "tp2-G2-depth3": ("partly_trained", dict(tensor_parallel_size=2, drafter_devices=2, compile_warmup=True)),
    "tp1-G2-depth2": ("two_modules", dict(drafter_devices=2)),  # k = 3 recurses on module 1's rank
    "tp1-G1-recursive": ("partly_trained", dict(drafter_devices=1, mtp_chain="recursive", compile_warmup=True)),
    # Padded to batch buckets as on a GPU, where the drafter rank replays its graphs (drafter_steps.py): the
    # pad rows' results and drafts must reach no request.
    "tp1-G1-padded": ("partly_trained", dict(drafter_devices=1, pad_uniform_steps=True, compile_warmup=True)),
    # Two drafter ranks padded as on a GPU: their chain changes hands with the pad rows, and at start both run
    # every prepared shape once on pad rows, in the same order, so that their hand-overs pair up.
    "tp1-G2-padded": ("two_modules", dict(drafter_devices=2, pad_uniform_steps=True)),
    # Steps overlapped (the default on CUDA): each target rank takes in the group's drafts for step n right
    # after launching it, before step n + 1 (launched before step n is read) verifies them.
    "tp1-G1-overlapped": ("partly_trained", dict(drafter_devices=1, async_scheduling=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_replica_takes_uniform_steps_and_matches_single_process(request: pytest.FixtureRequest, local_ray,
                                                                      layout: str) -> None:
    fixture, group = LAYOUTS[layout]
    path = request.getfixturevalue(fixture)
    chain = {k: v for k, v in group.items() if k == "mtp_chain"}
    expected = _workload(LLM(str(path), **ENGINE, **chain))
    llm = LLM(str(path), **ENGINE, **group)
    try:
        assert_same_outputs(_workload(llm), expected)
        counts = _uniform_steps(llm)
        assert counts[0] > 50, "most decode steps must be uniform for this test to bite"
        assert counts == [counts[0]] * len(counts), f"every rank takes the same uniform steps: {counts}"
        assert (llm.engine.num_overlapped_steps > 0) == bool(group.get("async_scheduling"))
        assert (llm.engine.num_warmup_steps > 0) == bool(group.get("compile_warmup"))
    finally:
        llm.shutdown()
