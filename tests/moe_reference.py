"""The plain-torch reference (tests/reference.py) with DeepSeek-V3 / GLM-4.5 MoE blocks and MLA.

Written token by token from the routing rule as the model cards state it, with every weight read by its
checkpoint name (per-expert tensors): nothing of mtpserve's MoE, config parsing or weight maps.
For each token: s = sigmoid(W_gate h); choice = s + bias; groups ranked by the sum of their two best
choice scores, the best topk_group kept; the top_k experts by choice among them; weights = s of those,
divided by their sum when norm_topk_prob, times routed_scaling_factor; out = sum_e w_e * MLP_e(h)
+ shared MLP(h).

Latent attention is computed in the expanded (naive) form: every head's keys and values are
materialised from the latent with kv_b_proj, and the rope pairs (x0, x1), (x2, x3), ... are rotated in
place. YaRN's frequencies and cos/sin factor come from transformers' rope functions (the outside
statement of YaRN), the softmax mscale from the DeepSeek-V3 formula.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.reference import Reference


class MoEReference(Reference):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        raw = json.loads((path / "config.json").read_text())
        self.num_experts = raw["n_routed_experts"]
        self.top_k = raw["num_experts_per_tok"]
        self.groups = raw.get("n_group") or 1
        self.top_groups = raw.get("topk_group") or 1
        self.norm_top_k = raw.get("norm_topk_prob", True)
        self.scaling = raw.get("routed_scaling_factor", 1.0)
        if "kv_lora_rank" in raw:
            self._init_mla(path, raw)

    def _init_mla(self, path: Path, raw: dict) -> None:
        import transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.dims = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"], raw["kv_lora_rank"]
        self.interleave = raw.get("rope_interleave", True)
        rope = raw.get("rope_parameters") or {}
        self.mla_scale = (self.dims[0] + self.dims[1]) ** -0.5
        if self.rope_type == "default":
            d = self.dims[1]
            self.inv_freq, self.cos_sin_factor = 1.0 / self.theta ** (torch.arange(0, d, 2).float() / d), 1.0
        else:
            hf_config = transformers.AutoConfig.from_pretrained(str(path))
            self.inv_freq, self.cos_sin_factor = ROPE_INIT_FUNCTIONS[self.rope_type](hf_config, "cpu")
            if rope.get("mscale_all_dim"):
                self.mla_scale *= (0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0) ** 2

    def rope_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [S, H, d] at positions 0..S-1: pair (x_2j, x_2j+1) when interleaved, else (x_j, x_j+d/2)."""
        angles = torch.arange(x.shape[0]).float()[:, None, None] * self.inv_freq.float()
        cos, sin = angles.cos() * self.cos_sin_factor, angles.sin() * self.cos_sin_factor
        d = x.shape[-1]
        first, second = (x[..., 0::2], x[..., 1::2]) if self.interleave else (x[..., : d // 2], x[..., d // 2:])
        out = torch.empty_like(x)
        rotated = first * cos - second * sin, second * cos + first * sin
        if self.interleave:
            out[..., 0::2], out[..., 1::2] = rotated
        else:
            out[..., : d // 2], out[..., d // 2:] = rotated
        return out

    def attention(self, p: str, h: torch.Tensor) -> torch.Tensor:
        if p + "kv_b_proj.weight" not in self.w:
            return super().attention(p, h)
        (nope, rope, v_dim, rank), s, heads = self.dims, h.shape[0], self.heads
        if p + "q_proj.weight" in self.w:
            q = self.linear(h, p + "q_proj")
        else:
            q = self.linear(self.rms(self.linear(h, p + "q_a_proj"), self.w[p + "q_a_layernorm.weight"]), p + "q_b_proj")
        q_nope, q_rope = q.view(s, heads, nope + rope).split([nope, rope], dim=-1)
        latent, k_rope = self.linear(h, p + "kv_a_proj_with_mqa").split([rank, rope], dim=-1)
        latent = self.rms(latent, self.w[p + "kv_a_layernorm.weight"])
        k_nope, v = self.linear(latent, p + "kv_b_proj").view(s, heads, nope + v_dim).split([nope, v_dim], dim=-1)
        k_rope = self.rope_pairs(k_rope[:, None, :]).expand(s, heads, rope)
        q = torch.cat((q_nope, self.rope_pairs(q_rope)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        out = self.causal_attention(q, k, v, self.mla_scale)
        return self.linear(out.reshape(s, heads * v_dim), p + "o_proj")

    def mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        if p + "gate.weight" not in self.w:
            return super().mlp(p, h)
        out = torch.zeros_like(h)
        if p + "shared_experts.gate_proj.weight" in self.w:
            out += super().mlp(p + "shared_experts.", h)
        for t in range(h.shape[0]):
            for expert, weight in self.route(p, h[t]):
                out[t] += weight * super().mlp(f"{p}experts.{expert}.", h[t : t + 1])[0]
        return out

    def route(self, p: str, h: torch.Tensor) -> list[tuple[int, float]]:
        scores = torch.sigmoid(self.w[p + "gate.weight"] @ h)
        choice = (scores + self.w[p + "gate.e_score_correction_bias"]).tolist()
        size = self.num_experts // self.groups
        group_rank = sorted(range(self.groups), key=lambda g: -sum(sorted(choice[g * size:(g + 1) * size])[-2:]))
        eligible = [e for g in group_rank[: self.top_groups] for e in range(g * size, (g + 1) * size)]
        chosen = sorted(eligible, key=lambda e: -choice[e])[: self.top_k]
        weights = [float(scores[e]) for e in chosen]
        total = sum(weights) if self.norm_top_k else 1.0
        return [(e, w / total * self.scaling) for e, w in zip(chosen, weights)]
