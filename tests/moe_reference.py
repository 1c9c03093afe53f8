"""The plain-torch reference (tests/reference.py) with DeepSeek-V3 / GLM-4.5 MoE blocks.

Written token by token from the routing rule as the model cards state it, with every weight read by its
checkpoint name (per-expert tensors): nothing of mtpserve's MoE, config parsing or weight maps.
For each token: s = sigmoid(W_gate h); choice = s + bias; groups ranked by the sum of their two best
choice scores, the best topk_group kept; the top_k experts by choice among them; weights = s of those,
divided by their sum when norm_topk_prob, times routed_scaling_factor; out = sum_e w_e * MLP_e(h)
+ shared MLP(h).
"""

from __future__ import annotations

import json
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
