"""Tensor-parallel target and drafter group on Ray (gloo on CPU) against the single-process engine.

Every configuration must give the single-process engine's outputs token for token: greedy for k = 0..3
on ten prompts, and seeded sampled requests (top-p, top-k, penalties), all in one batch under chunked
prefill and short of KV blocks, so requests are also preempted and recomputed (every rank must drop
and re-admit them in step with the scheduler).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from mtpserve import LLM, SamplingParams
from tests.checkpoints import make_hf_checkpoint
from tests.cluster.ray_helpers import assert_same_outputs, generate, start_local_ray
from tests.conftest import prompts_of

pytestmark = pytest.mark.slow  # several processes (Ray workers), each importing torch

SHORT_OF_BLOCKS = dict(num_kv_blocks=40)


@pytest.fixture(scope="module")
def reference(partly_trained: Path) -> list:
    outs, llm = generate(partly_trained, **SHORT_OF_BLOCKS)
    assert llm.engine.scheduler.num_preemptions > 0
    return outs


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.mark.parametrize("drafters, overlap", [(0, False), (2, False), (0, True)],
                         ids=["tp2-colocated", "tp2-drafters2", "tp2-overlapped"])
def test_tensor_parallel_matches_single_process(partly_trained: Path, reference: list, local_ray,
                                                drafters: int, overlap: bool) -> None:
    """Overlapped: the engine launches decode step n + 1 before it reads step n, and the ranks hold step n's
    result until then (on CUDA the default; here forced on over gloo)."""
    outs, llm = generate(partly_trained, tensor_parallel_size=2, drafter_devices=drafters, async_scheduling=overlap,
                         **SHORT_OF_BLOCKS)
    try:
        assert (llm.engine.num_overlapped_steps > 0) == overlap
        assert llm.engine.scheduler.num_preemptions > 0
        assert all(h > 0 for h in llm.engine.blocks.hits), "prefix-cache hits in every group, on every rank"
        assert_same_outputs(outs, reference)
        assert llm.engine.blocks.all_free
    finally:
        llm.shutdown()


def test_odd_vocabulary_biases_and_per_module_heads(tmp_path: Path, local_ray) -> None:
    """Vocabulary 97 (padded shards), attention biases (o_proj's added once, after the all-reduce), and MTP
    modules with their own embedding and head (sharded too when the drafter is colocated)."""
    path = make_hf_checkpoint(tmp_path / "llama", family="llama", num_mtp=2, attention_bias=True,
                              mtp_own_head=True, mtp_own_embed=True)
    prompts = prompts_of(97, [3, 9, 21, 30], seed=5) * 3
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
              for k in (0, 1, 2) for _ in range(4)]
    expected = [o.token_ids for o in LLM(str(path), block_size=4).generate(prompts, params)]
    llm = LLM(str(path), block_size=4, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.shutdown()
