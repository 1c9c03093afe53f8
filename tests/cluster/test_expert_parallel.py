"""Expert parallelism: GLM-4.5-style and DeepSeek-V3-style MoE targets (and their MoE MTP layers) with
tensor_parallel_size 2 on Ray (gloo on CPU, fp32) against the single-process engine: each rank holds
half the routed experts and half the shared experts' units; GQA attention splits its heads, latent
attention its query heads (the latent pool is whole on each rank). Same request set as tests/cluster/test_ray_equivalence.py: greedy for
k = 0..3, seeded sampling with top-p, top-k and penalties, under chunked prefill.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from tests.cluster.ray_helpers import assert_same_outputs, generate, start_local_ray
from tests.moe_checkpoints import make_moe_checkpoint

pytestmark = pytest.mark.slow  # several processes (Ray workers), each importing torch


FAMILIES = {
    "glm4_moe": dict(n_shared_experts=2, n_group=4, topk_group=2, use_qk_norm=True),
    "deepseek_v3": dict(n_shared_experts=2, n_group=4, topk_group=2, q_lora_rank=None),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_ckpt(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param, num_mtp=3, seed=7,
                               predictable=True, tokenizer=True, **FAMILIES[request.param])


@pytest.fixture(scope="module")
def reference(moe_ckpt: Path) -> list:
    outs, llm = generate(moe_ckpt)
    return outs


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


def test_ranks_hold_disjoint_expert_slices(moe_ckpt: Path) -> None:
    """What each rank keeps: built in one process for ranks 0 and 1 of 2 (building calls no collective)."""
    from mtpserve.workers.expert_parallel import ExpertParallelMoE
    from mtpserve.workers.models.loader import load_model
    from mtpserve.workers.tensor_parallel import TPGroup

    full = load_model(moe_ckpt, torch.float32, "cpu").target.layers[1].mlp
    gate_up = full.experts.gate_up_proj.detach().clone()
    shared = full.shared_experts.down_proj.weight.detach().clone()
    parts = [ExpertParallelMoE(load_model(moe_ckpt, torch.float32, "cpu").target.layers[1].mlp, TPGroup(r, 2, None))
             for r in range(2)]
    assert [p.first for p in parts] == [0, 4]
    assert torch.equal(torch.cat([p.experts.gate_up_proj for p in parts]), gate_up)
    assert torch.equal(torch.cat([p.shared_down.weight for p in parts], dim=1), shared)


@pytest.mark.parametrize("drafters", [0, 2], ids=["tp2-colocated", "tp2-drafters2"])
def test_expert_parallel_matches_single_process(moe_ckpt: Path, reference: list, local_ray, drafters: int) -> None:
    outs, llm = generate(moe_ckpt, tensor_parallel_size=2, drafter_devices=drafters)
    try:
        assert_same_outputs(outs, reference)
        assert llm.engine.blocks.all_free
    finally:
        llm.shutdown()
