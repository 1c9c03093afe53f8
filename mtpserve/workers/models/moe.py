"""The mixture-of-experts block of DeepSeek-V3 / GLM-4.5 over flat token rows [T, hidden].

Routing ("noaux_tc"): sigmoid scores; the correction bias only steers which experts are chosen, the
weights are the unbiased scores. Experts are grouped: each group is scored by the sum of its two best
(biased) scores, the best `top_k_groups` groups stay eligible, the top_k experts are taken from them;
the weights are renormalised when `norm_top_k` and multiplied by `routed_scaling`.

Compute: the (token, expert) pairs are sorted by expert and every expert's rows go through one grouped
GEMM (mtpserve/kernels/grouped_gemm*.py), then scale by the routing weight and sum back per token.
Shared experts are a dense SwiGLU MLP added to every token.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.kernels.grouped_gemm_ref import grouped_gemm_ref
from mtpserve.workers.models.config import ModelConfig, MoEConfig
from mtpserve.workers.models.layers import MLP


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        # fp32 whatever the model dtype, as the reference keeps it: it decides close choices.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64)."""
        moe = self.moe
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        if moe.top_k_groups < moe.num_groups:
            grouped = biased.view(x.shape[0], moe.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            kept = group_scores.topk(moe.top_k_groups, dim=-1).indices
            eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            biased = grouped.masked_fill(~eligible[..., None], float("-inf")).view_as(biased)
        experts = biased.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if moe.norm_top_k:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling, experts


class Experts(nn.Module):
    """All routed experts' weights as stacked tensors (gate|up fused, as in MLP)."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        inter = moe.intermediate_size
        self.moe = moe
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, inter))  # [E, H, I]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, first: int = 0) -> torch.Tensor:
        """x [T, H], weights/experts [T, top_k] -> sum over each token's experts of weight * expert(x).

        This module may hold a slice of the experts (expert parallelism): ids first .. first+E_local-1.
        Pairs routed elsewhere sort after every local group, the GEMMs leave them out (zero rows) and
        their weight is zeroed, so they add nothing."""
        top_k, num_local = experts.shape[1], self.gate_up_proj.shape[0]
        local = experts - first
        inside = (local >= 0) & (local < num_local)
        flat = torch.where(inside, local, num_local).reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k  # the token of each expert-sorted row
        # index_add, not bincount: bincount reads the largest id back to the host on CUDA.
        counts = torch.zeros(num_local + 1, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        offsets = F.pad(torch.cumsum(counts[:-1], 0), (1, 0))
        gate, up = self.matmul(x[token], "gate_up_proj", offsets).chunk(2, dim=-1)
        out = self.matmul(F.silu(gate) * up, "down_proj", offsets)
        out = out * (weights * inside).reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)

    def matmul(self, rows: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        """rows [N, K] sorted by expert through the stacked weight `name` -> [N, M] (FP8Experts overrides it)."""
        return _grouped_gemm(rows)(rows, getattr(self, name), offsets)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "MoE layer built for a dense config"
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = Experts(cfg.hidden_size, moe)
        shared = moe.num_shared_experts * moe.intermediate_size
        self.shared_experts = MLP(cfg, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)



def _grouped_gemm(x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The Triton grouped GEMM on CUDA (no host sync), its plain-torch reference elsewhere."""
    if x.is_cuda:
        from mtpserve.kernels.grouped_gemm import grouped_gemm

        return grouped_gemm
    return grouped_gemm_ref
