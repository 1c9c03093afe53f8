"""The compile warm-up (cluster/warmup.py): synthetic prompts through every rank before serving, which must leave
no trace in what the replica then serves. The group layouts run it too (test_ray_group_uniform.py)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtpserve.boundary.channel import Channel
from mtpserve.boundary.messages import StepResult
from mtpserve.cluster import warmup
from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig, ResolvedConfig
from mtpserve.errors import WorkerLost
from mtpserve.sampling_params import SamplingParams
from tests.conftest import prompts_of

PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=3),
          SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, num_speculative_tokens=2),
          SamplingParams(max_tokens=20, temperature=0.8, top_k=10, repetition_penalty=1.3, seed=8, ignore_eos=True,
                         logprobs=2, num_speculative_tokens=3)]


def _config(ckpt: Path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(ckpt), device="cpu", dtype="float32", num_speculative_tokens=3, max_num_seqs=8,
                        **overrides)


def _serve(engine: LLMEngine) -> list:
    outs = {}
    for i, (prompt, params) in enumerate(zip(prompts_of(64, [4, 11, 23], seed=5), PARAMS)):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return [outs[f"r{i}"] for i in range(len(PARAMS))]


def test_the_plans_step_through_attentions_tiles_and_free_every_request(partly_trained: Path) -> None:
    r = ResolvedConfig.resolve(_config(partly_trained, max_model_len=200))
    plans = warmup.plans(r)
    lengths = [p.num_tokens[0] for p in plans if len(p.req_ids) == 1]
    assert lengths[: len(warmup.LENGTHS) - 1] == [n for n in warmup.LENGTHS if n + 4 < 200]  # 250 does not fit
    assert {1, 16, 17} <= set(lengths)  # Triton's integer classes: 1, multiples of 16, the rest
    assert any(len(p.req_ids) > 1 for p in plans), "one step of several requests"
    assert any(q.params.temperature > 0 and q.params.logprobs for p in plans for q in p.new_requests)
    for run, free in zip(plans[::2], plans[1::2]):  # every step of new requests, then a step freeing them
        assert free.freed_ids == run.req_ids and not free.req_ids
        assert all(q.request_id.startswith(warmup.WARMUP_PREFIX) for q in run.new_requests)
        blocks = [b for q in run.new_requests for b in q.block_ids[0]]
        assert len(blocks) == len(set(blocks)) and max(blocks) < r.num_blocks
        for q in run.new_requests:  # room for the prompt and the drafts of its first step, in every KV group
            assert len(q.block_ids) == 1 + r.num_mtp_modules
            assert len(q.block_ids[0]) * r.config.block_size >= q.num_prompt_tokens + q.num_spec + 1
    # The replica's own k, past its modules where the chain recurses (one module, three drafts).
    recursive = ResolvedConfig.resolve(_config(partly_trained, mtp_chain="recursive"))
    assert {q.num_spec for p in warmup.plans(recursive) for q in p.new_requests} == {3}


def test_warmed_up_replica_serves_the_same_tokens_and_keeps_no_synthetic_request(partly_trained: Path) -> None:
    cold = LLMEngine(_config(partly_trained))
    assert cold.num_warmup_steps == 0, "off by default on the CPU"
    expected = _serve(cold)
    warm = LLMEngine(_config(partly_trained, compile_warmup=True))
    assert warm.num_warmup_steps == len(warmup.plans(warm.resolved)) > 10
    assert not warm.executor.runner.requests, "every synthetic request was freed"
    for got, want in zip(_serve(warm), expected):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.logprobs == want.logprobs
    assert warm.blocks.all_free


def test_on_by_default_where_prompts_take_the_eager_path_on_a_gpu() -> None:
    def wanted(device: str, **overrides) -> bool:
        return warmup.wanted(SimpleNamespace(config=EngineConfig(**overrides), device=torch.device(device)))

    assert wanted("cuda", drafter_devices=1) and wanted("cuda", prefill_step_rows=0)
    assert wanted("cuda", uniform_steps=False)  # no prefill steps without uniform steps either
    assert not wanted("cuda") and not wanted("cuda", tensor_parallel_size=2)  # prefill steps: captured at start
    assert not wanted("cpu", drafter_devices=1)  # nothing compiles there
    assert not wanted("cuda", drafter_devices=1, capture_graphs_at_start=False)  # a start kept short on purpose
    assert wanted("cpu", compile_warmup=True) and not wanted("cuda", drafter_devices=1, compile_warmup=False)


def test_its_steps_run_under_the_start_up_timeout_of_an_executor_that_detects_hangs(partly_trained: Path) -> None:
    """RayExecutor.compiling: each warm-up step may compile several kernels; the hang detector's limit (twice the
    slowest step seen plus a margin) would call such a step a hung worker, as it did in run 210."""

    class Recording:
        compiling = False

        def __init__(self) -> None:
            self.seen: list[bool] = []

        def execute(self, plan):
            self.seen.append(self.compiling)

    executor = Recording()
    assert warmup.run(executor, ResolvedConfig.resolve(_config(partly_trained))) == len(executor.seen) > 0
    assert all(executor.seen) and executor.compiling is False


def _executor_answering_after(seconds: float, warm: bool, compiling: bool):
    """A RayExecutor (its step-result wait only) whose one worker answers the next step after `seconds`, with a hang
    detector that allows 0.05 s a step once warm (and looks every 0.5 s); -> (executor, the pending answer)."""
    from mtpserve.cluster.ray_executor import RayExecutor

    listener = socket.create_server(("127.0.0.1", 0))
    worker = Channel(socket.create_connection(listener.getsockname()))
    driver = Channel(listener.accept()[0])
    listener.close()
    ex = object.__new__(RayExecutor)
    ex._by_fd, ex._fds = {driver.fileno(): (driver, "target worker (rank 0)")}, [driver.fileno()]
    ex._resolved = SimpleNamespace(config=SimpleNamespace(startup_timeout_s=30.0, step_timeout_s=0.05,
                                                          step_timeout_margin_s=0.0))
    ex._warm, ex.compiling, ex._slowest_step = warm, compiling, 0.0
    ex._check_alive = lambda: None
    answer = threading.Timer(seconds, lambda: worker.send(("result", StepResult())))
    answer.start()
    return ex, answer


def test_a_warm_up_step_may_outlast_the_hang_detector_and_leaves_the_start_up_regime_on() -> None:
    ex, _ = _executor_answering_after(0.7, warm=False, compiling=True)
    assert isinstance(ex._await_result(), StepResult)
    assert not ex._warm and ex._slowest_step == 0.0  # the first served step may still compile; nothing was timed
    ex, _ = _executor_answering_after(0.7, warm=True, compiling=True)  # a recovery's warm-up
    ex._await_result()
    ex, answer = _executor_answering_after(2.0, warm=True, compiling=False)  # a served step as long: a hung worker
    t0 = time.monotonic()
    with pytest.raises(WorkerLost, match="ran past the step timeout"):
        ex._await_result()
    assert time.monotonic() - t0 < 2.0
    answer.cancel()
