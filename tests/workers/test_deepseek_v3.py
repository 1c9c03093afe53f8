"""DeepSeek-V3-style targets (DeepseekV3ForCausalLM): multi-head latent attention and MoE, fp32 on CPU.

The target's logits equal transformers' with and without q_lora, with YaRN scaling (mscale and
mscale_all_dim) and without, interleaved rope pairs or not, over several routing settings: prefill of
several requests in one flat batch, paged decode across block boundaries, chunked prefill (the bodies
of tests/workers/test_models.py). The paged pool of an MLA layer holds one entry per token, the latent
plus the rope key, and attention runs in the absorbed form against it. The MTP layers (MLA + MoE) equal
the teacher-forced reference, which computes MLA in the expanded form (tests/moe_reference.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.kv_cache import KVPools, bytes_per_block
from mtpserve.workers.models.layers import rope_attention_factor, rope_inv_freq
from mtpserve.workers.models.mla import MLAttention
from tests.workers.moe_fixtures import moe_fixtures
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

YARN = {"type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}
CONFIGS = {
    "qlora-yarn-grouped-scaled": dict(rope_scaling=YARN, n_group=4, topk_group=2, routed_scaling_factor=2.5, seed=1),
    "noqlora-plainrope-noshared-unnormed": dict(
        q_lora_rank=None, n_shared_experts=0, norm_topk_prob=False, first_k_dense_replace=0, seed=2,
    ),
    "noqlora-yarn-halves-2dense-tied-bias": dict(
        q_lora_rank=None, rope_scaling={**YARN, "mscale_all_dim": 1.0, "factor": 8.0}, rope_interleave=False,
        first_k_dense_replace=2, tie_word_embeddings=True, attention_bias=True, num_experts_per_tok=2, n_group=2,
        topk_group=1, seed=3,
    ),
}
NUM_MTP = 2
models, case = moe_fixtures("deepseek_v3", CONFIGS, NUM_MTP)


def test_config_rope_and_scale_match_transformers(models):
    hf, ours, name = models
    cfg, raw = ours.config, CONFIGS[name]
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.mla is not None and cfg.moe is not None
    assert (cfg.mla.q_lora_rank is None) == ("q_lora_rank" in raw)
    assert cfg.rope.kind == ("yarn" if "rope_scaling" in raw else "default")
    torch.testing.assert_close(rope_inv_freq(cfg.rope, cfg.rotary_dim), hf.model.rotary_emb.inv_freq.float(),
                               rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg.rope) == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    for ours_layer, hf_layer in zip(ours.target.layers, hf.model.layers):
        assert isinstance(ours_layer.self_attn, MLAttention)
        assert ours_layer.self_attn.scale == pytest.approx(hf_layer.self_attn.scaling, rel=1e-12)
    if "rope_scaling" in raw:
        assert rope_attention_factor(cfg.rope) != 1.0 or raw["rope_scaling"]["mscale_all_dim"] == 1.0
        assert ours.target.layers[0].self_attn.scale != pytest.approx((16 + 8) ** -0.5)


def test_latent_pool_holds_one_entry_per_token(models):
    _, ours, _ = models
    cfg = ours.config
    pools = KVPools.allocate(cfg, num_blocks=5, block_size=4, num_modules=NUM_MTP, dtype=torch.float32, device="cpu")
    for layer in pools.target + pools.mtp:
        assert layer.k is layer.v
        assert tuple(layer.k.shape) == (5, 4, 1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    per_token = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2  # bf16 bytes
    assert bytes_per_block(cfg, 4, NUM_MTP, torch.bfloat16) == 4 * per_token * (cfg.num_layers + NUM_MTP)


def test_tensor_parallel_splits_query_heads_not_the_latent(models):
    from mtpserve.workers.tensor_parallel import check_shardable

    _, ours, _ = models
    check_shardable(ours.config, 2)  # 4 query heads; the latent has one "head" and is not split
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 8 does not divide this model's num_attention_heads \(4\)"):
        check_shardable(ours.config, 8)
