"""Shared pieces of the Ray tests: a mixed request set, how to run it, and how to compare two runs.

Not a test module. The request set puts every k in 0..3 on the same ten prompts (greedy), plus seeded
sampled requests with top-p, top-k and penalties, in one batch under chunked prefill; the reference is
the single-process engine with the same settings.
"""

from __future__ import annotations

import threading
from pathlib import Path

import ray

from mtpserve import LLM, SamplingParams
from tests.conftest import prompts_of

LENGTHS = [1, 2, 5, 8, 13, 17, 24, 31, 40, 3]
ENGINE = dict(block_size=4, max_num_batched_tokens=32)


def request_set(vocab: int = 64, max_tokens: int = 16) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = prompts_of(vocab, LENGTHS, seed=11)
    greedy = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
              for k in range(4) for _ in prompts]
    sampled = [SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True,
                              num_speculative_tokens=i % 4) for i in range(len(prompts))]
    penalised = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=20, repetition_penalty=1.3,
                                presence_penalty=0.4, frequency_penalty=0.2, seed=200 + i, ignore_eos=True,
                                num_speculative_tokens=3, logprobs=2) for i in range(len(prompts))]
    return prompts * 6, greedy + sampled + penalised


def generate(path: Path, **engine_args) -> tuple[list, LLM]:
    prompts, params = request_set()
    llm = LLM(str(path), **{**ENGINE, **engine_args})
    return llm.generate(prompts, params), llm


def assert_same_outputs(actual: list, expected: list) -> None:
    """Token for token, the same acceptance pattern, and the same logprobs (up to float rounding)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.token_ids == e.token_ids, f"request {i}: tokens differ"
        assert a.accepted_per_step == e.accepted_per_step, f"request {i}: acceptance differs"
        assert (a.logprobs is None) == (e.logprobs is None)
    greedy = [o for o in expected[:40] if o.accepted_per_step]
    accepted = [x for o in greedy for x in o.accepted_per_step]
    assert 0 < sum(accepted) < 3 * len(accepted), "drafts must be both accepted and rejected"


def start_local_ray(num_cpus: int = 4) -> None:
    """A local Ray instance for one test module; tried twice, since on a loaded CI machine the raylet
    sometimes misses Ray's own 30 s start-up deadline."""
    for attempt in range(2):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception:
            ray.shutdown()
            if attempt:
                raise


def stop_serve_router_loop(timeout_s: float = 10.0) -> None:
    """Stop the event loop that Ray Serve's first handle call starts in a daemon thread of this process.

    serve.shutdown() leaves it running, with a task that records Ray metrics every few seconds: after
    ray.shutdown() those calls reach a core worker that is gone, and if the thread is still running
    when the interpreter finalises it may crash the pytest process after every test passed (a likely
    cause of the exit code 139 CI saw once). Ray has no public call for this, hence the internal class.
    """
    from ray.serve._private.router import SingletonThreadRouter

    loop, monitor = SingletonThreadRouter._asyncio_loop, SingletonThreadRouter._event_loop_monitor
    if loop is None:
        return
    if monitor is not None:
        loop.call_soon_threadsafe(monitor.stop)
    loop.call_soon_threadsafe(loop.stop)
    for thread in threading.enumerate():
        if thread.name.endswith("(_run_router_event_loop)"):
            thread.join(timeout_s)
            assert not thread.is_alive(), "Ray Serve's router loop did not stop"
    loop.close()
    SingletonThreadRouter._asyncio_loop = SingletonThreadRouter._event_loop_monitor = None
