"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache, in the absorbed form.

Per token the cache holds one entry of width kv_lora_rank + rope: the normalised latent c and the
rotated rope key shared by all heads. kv_b_proj maps c to every head's non-rope key (W_uk) and value
(W_uv); both are folded into the query and the output instead of being applied to the cache:

  score_h(i, j) = q_nope_h(i) . (W_uk_h c_j) + q_rope_h(i) . k_rope_j = [W_uk_h^T q_nope_h(i), q_rope_h(i)] . entry_j
  out_h(i)      = W_uv_h (sum_j p_h(i, j) c_j)

so attention is multi-query attention against the latent pool; prefill and decode take the same path.
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.workers.attention import AttentionMetadata, LayerKV, attend_latent
from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.layers import RMSNorm, RotaryEmbedding, yarn_mscale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "MLA built for a config without it"
        self.mla, self.num_heads, self.num_kv_heads = mla, cfg.num_heads, 1
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        hidden, heads = cfg.hidden_size, cfg.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=cfg.o_bias)
        self.rotary = rotary
        self.scale = qk_dim**-0.5
        if cfg.rope.kind == "yarn" and cfg.rope.mscale_all_dim:
            self.scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Interleaved pairs (x0, x1), (x2, x3), ... become halves: the same rotation in rotate-half form,
        # up to a permutation of the dims that queries and keys share (so every dot product is unchanged).
        if self.mla.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return self.rotary(x, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: LayerKV) -> torch.Tensor:
        mla, heads = self.mla, self.num_heads
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(-1, heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        entry = torch.cat((self.kv_a_layernorm(latent), self._rope(k_rope[:, None, :], positions)[:, 0]), dim=-1)
        w_kv = self.kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, kv_lora_rank]
        q_entry = torch.cat((q_latent, self._rope(q_rope, positions)), dim=-1)  # [T, H, latent_dim]
        out = attend_latent(q_entry, entry[:, None, :], kv, meta, self.scale, mla.kv_lora_rank)
        out = torch.einsum("thr,hvr->thv", out, w_uv)  # [T, H, v_head_dim]
        return self.o_proj(out.reshape(-1, heads * mla.v_head_dim))
