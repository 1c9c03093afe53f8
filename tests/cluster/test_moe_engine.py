"""GLM-4.5-style (GQA + MoE) and DeepSeek-V3-style (MLA + MoE) targets with their MTP layers through the
speculative engine (CPU, fp32).

Greedy output is identical for every k and equal to transformers' generate; the accepted counts
replay exactly from teacher-forced predictions of the independent MoE reference (depth and recursive
chains). The checkpoint is random but `predictable` (tests/moe_checkpoints.py), so drafts are both
accepted and rejected.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtpserve import LLM, SamplingParams
from tests.checkpoints import load_hf_model
from tests.cluster.test_speculative_engine import _replay
from tests.conftest import prompts_of
from tests.moe_checkpoints import make_moe_checkpoint
from tests.moe_reference import MoEReference

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
VOCAB = 97


FAMILIES = {
    "glm4_moe": dict(use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v3": dict(n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_scaling={
        "type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.7}),
}


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def ckpt(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param, num_mtp=3, seed=7,
                               predictable=True, tokenizer=True, **FAMILIES[request.param])


def test_greedy_outputs_identical_for_every_k_and_equal_to_transformers(ckpt: Path) -> None:
    prompts = prompts_of(VOCAB, [1, 4, 9, 17, 30, 6], seed=3)
    hf = load_hf_model(ckpt)
    expected = [
        hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=None)[0, len(p):].tolist()
        for p in prompts
    ]
    accepted_any = rejected_any = False
    for k in range(4):
        llm = LLM(str(ckpt), num_speculative_tokens=k, block_size=4, num_kv_blocks=80, max_num_batched_tokens=24)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected, f"k={k}"
        assert llm.engine.blocks.all_free
        steps = [a for o in outs for a in o.accepted_per_step]
        accepted_any |= sum(steps) > 0
        rejected_any |= any(a < k for a in steps)
    assert accepted_any and rejected_any, "drafts must be both accepted and rejected"


@pytest.mark.parametrize("mode", ["depth", "recursive"])
def test_accepted_counts_replay_teacher_forced_predictions(ckpt: Path, mode: str) -> None:
    prompts = prompts_of(VOCAB, [5, 13, 2], seed=4)
    llm = LLM(str(ckpt), num_speculative_tokens=3, mtp_chain=mode, block_size=4)
    outs = llm.generate(prompts, GREEDY)
    ref = MoEReference(ckpt)
    replayed = []
    for prompt, out in zip(prompts, outs):
        expected = _replay(ref, prompt + out.token_ids, len(prompt), 3, GREEDY.max_tokens, mode)
        assert out.accepted_per_step == expected
        replayed += expected
    assert len(set(replayed)) > 2, f"the replay must cover several acceptance patterns, got {replayed}"
