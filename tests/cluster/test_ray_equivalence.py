"""Tensor-parallel target and drafter group on Ray (gloo on CPU) against the single-process engine.

Every configuration must give the single-process engine's outputs token for token: greedy for k = 0..3
on ten prompts, and seeded sampled requests (top-p, top-k, penalties) too, in one batch under chunked
prefill; another run is short of KV blocks so requests get preempted and recomputed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from tests.cluster.ray_helpers import assert_same_outputs, generate


@pytest.fixture(scope="module")
def ckpt(partly_trained: Path) -> Path:
    return partly_trained


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list:
    outs, _ = generate(ckpt)
    return outs


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("drafters", [0, 2], ids=["tp2-colocated", "tp2-drafters2"])
def test_tensor_parallel_matches_single_process(ckpt: Path, reference: list, local_ray, drafters: int) -> None:
    outs, llm = generate(ckpt, tensor_parallel_size=2, drafter_devices=drafters)
    try:
        assert_same_outputs(outs, reference)
        assert llm.engine.blocks.all_free
    finally:
        llm.shutdown()


def test_drafter_group_under_preemption(ckpt: Path, local_ray) -> None:
    """Freed and re-admitted requests keep every drafter rank's state in step with the target's."""
    expected, ref_llm = generate(ckpt, num_kv_blocks=40)
    assert ref_llm.engine.scheduler.num_preemptions > 0
    outs, llm = generate(ckpt, num_kv_blocks=40, tensor_parallel_size=1, drafter_devices=3)
    try:
        assert llm.engine.scheduler.num_preemptions == ref_llm.engine.scheduler.num_preemptions
        assert_same_outputs(outs, expected)
    finally:
        llm.shutdown()


def test_odd_vocabulary_biases_and_per_module_heads(tmp_path: Path, local_ray) -> None:
    """Vocabulary 97 (padded shards), attention biases (o_proj's added once, after the all-reduce), and MTP
    modules with their own embedding and head (sharded too when the drafter is colocated)."""
    from mtpserve import LLM, SamplingParams
    from tests.checkpoints import make_hf_checkpoint
    from tests.conftest import prompts_of

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
