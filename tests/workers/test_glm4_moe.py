"""GLM-4.5-style MoE targets (Glm4MoeForCausalLM) and their MTP layers, fp32 on CPU.

The target's logits equal transformers' over several routing settings (expert groups, shared experts,
first dense layers, scaling, normalised or not, q/k norm, partial rotary, tied head): whole-prompt
prefill of several requests in one flat batch, paged decode across KV block boundaries, chunked
prefill. The test bodies are the dense models' (tests/workers/test_models.py) run on these checkpoints.
The MTP layers (a whole MoE decoder layer each, DeepSeek naming) equal the teacher-forced reference with
its own token-by-token router (tests/moe_reference.py), with tests/workers/test_mtp.py's bodies.
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.errors import CheckpointError
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.layers import rope_inv_freq
from mtpserve.workers.models.moe import MoE
from mtpserve.workers.tensor_parallel import check_shardable
from tests.checkpoints import read_config
from tests.workers.moe_fixtures import build_moe, moe_fixtures
from tests.workers.test_models import (  # noqa: F401  (collected here with this module's `models`)
    test_chunked_prefill_equals_whole_prefill,
    test_flat_batch_prefill_matches_transformers,
    test_paged_decode_token_by_token_matches_transformers,
)
from tests.workers.test_mtp import (  # noqa: F401  (collected here with this module's `case`)
    test_mtp_flat_batch_matches_teacher_forced_reference,
    test_mtp_incremental_steps_match_reference,
    test_reference_target_matches_transformers,
)

CONFIGS = {
    "grouped-qknorm-scaled": dict(use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5, seed=1),
    "ungrouped-noshared-unnormed-nodense": dict(
        n_shared_experts=0, norm_topk_prob=False, first_k_dense_replace=0, partial_rotary_factor=1.0,
        attention_bias=False, seed=2,
    ),
    "2shared-2dense-tied-quarterrotary": dict(
        n_shared_experts=2, first_k_dense_replace=2, tie_word_embeddings=True, num_experts_per_tok=2, n_group=2,
        topk_group=1, partial_rotary_factor=0.25, routed_scaling_factor=1.8, seed=3,
    ),
}
NUM_MTP = 2
models, case = moe_fixtures("glm4_moe", CONFIGS, NUM_MTP)


def _build(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return build_moe("glm4_moe", CONFIGS, NUM_MTP, name, tmp_path_factory)


def test_config_layers_and_rope_match_transformers(models):
    hf, ours, name = models
    cfg, raw = ours.config, CONFIGS[name]
    assert cfg.architecture == "Glm4MoeForCausalLM" and cfg.moe is not None
    assert cfg.rotary_dim == int(cfg.head_dim * raw.get("partial_rotary_factor", 0.5))
    torch.testing.assert_close(rope_inv_freq(cfg.rope, cfg.rotary_dim), hf.model.rotary_emb.inv_freq.float(),
                               rtol=1e-6, atol=0)
    dense = raw.get("first_k_dense_replace", 1)
    assert [isinstance(layer.mlp, MoE) for layer in ours.target.layers] == [i >= dense for i in range(cfg.num_layers)]
    assert all(isinstance(m.block.mlp, MoE) for m in ours.mtp.mtp), "the MTP layers carry the MoE block"
    shared = raw.get("n_shared_experts", 1)
    assert all((layer.mlp.shared_experts is None) == (shared == 0) for layer in ours.target.layers[dense:])
    assert (ours.target.layers[0].self_attn.q_norm is not None) == raw.get("use_qk_norm", False)


@torch.no_grad()
def test_routing_settings_change_the_choice(tmp_path_factory):
    """The group restriction, the correction bias and the scaling each change the routed result, so
    matching transformers above means each is implemented, not just present."""
    path, ours = _build("grouped-qknorm-scaled", tmp_path_factory)
    moe = ours.target.layers[1].mlp
    x = torch.randn(64, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, experts = moe.gate(x)
    size = moe.gate.moe.num_experts // moe.gate.moe.num_groups
    assert ((experts // size).unique(dim=None).numel() > 2), "tokens should reach more than two groups overall"
    assert all(len(set((row // size).tolist())) <= 2 for row in experts), "at most topk_group groups per token"
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))
    bias = moe.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    saved = bias.detach().clone()
    bias.data.zero_()
    try:
        _, unbiased = moe.gate(x)
    finally:
        bias.data.copy_(saved)
    assert not torch.equal(unbiased.sort(-1).values, experts.sort(-1).values)


def test_bad_moe_configs_are_refused_by_field(tmp_path_factory):
    path, _ = _build("grouped-qknorm-scaled", tmp_path_factory)
    raw = read_config(path)
    for field, value, words in (("n_group", 3, "n_group"), ("topk_group", 5, "topk_group"),
                                ("scoring_func", "softmax", "scoring_func"), ("topk_method", "greedy", "topk_method")):
        with pytest.raises(CheckpointError, match=words):
            ModelConfig.from_dict({**raw, field: value})
    missing = {k: v for k, v in raw.items() if k != "moe_intermediate_size"}
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        ModelConfig.from_dict(missing)
    with pytest.raises(CheckpointError, match="quantization method 'awq'"):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "awq", "bits": 4}})


def test_tensor_parallel_checks_the_expert_split(tmp_path_factory):
    path, ours = _build("grouped-qknorm-scaled", tmp_path_factory)
    check_shardable(ours.config, 2)  # 8 experts, 24 shared units: expert parallel over 2 ranks
    odd = ModelConfig.from_dict({**read_config(path), "n_routed_experts": 9, "n_group": 1, "topk_group": 1})
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide this model's n_routed_experts \(9\)"):
        check_shardable(odd, 2)
