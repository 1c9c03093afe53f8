"""Expert parallelism over the tensor-parallel ranks: each rank holds a contiguous slice of an MoE
layer's routed experts, and a 1/world slice of its shared experts' intermediate units.

Tensor parallelism leaves every rank with the same full activations, so no token has to travel: each
rank routes every token (the router is replicated; identical inputs give identical choices), runs only
the (token, expert) pairs whose expert it holds, adds its partial shared-expert output (column-parallel
gate/up, row-parallel down, not yet summed), and one all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.workers.models.moe import MoE
from mtpserve.workers.tensor_parallel import TPGroup, _block, _column, _param, all_reduce, partial_product


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: MoE, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.gate = tp, moe.gate
        num_local = moe.experts.gate_up_proj.shape[0] // tp.world
        self.first = tp.rank * num_local
        self.experts = moe.experts
        local = slice(self.first, self.first + num_local)
        for name, stacked in list(moe.experts.named_parameters(recurse=False)):  # weights (and FP8 scales)
            setattr(self.experts, name, _param(stacked[local]))
        self.shared_gate_up: nn.Module | None = None
        if moe.shared_experts is not None:
            inter = moe.shared_experts.gate_up_proj.out_features // 2
            units = _block(tp.rank, inter // tp.world)
            self.shared_gate_up = _column(moe.shared_experts.gate_up_proj, torch.cat((units, inter + units)))
            self.shared_down = partial_product(moe.shared_experts.down_proj, units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x), first=self.first)
        if self.shared_gate_up is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + self.shared_down(nn.functional.silu(gate) * up)
        return all_reduce(out, self.tp)


def check_expert_parallel(moe_experts: int, shared_units: int, world: int) -> None:
    """Raise ValueError naming the MoE dimension that `world` ranks cannot split evenly."""
    for name, value in (("n_routed_experts", moe_experts), ("moe_intermediate_size * n_shared_experts", shared_units)):
        if value % world:
            raise ValueError(f"tensor_parallel_size: {world} does not divide this model's {name} ({value})")

