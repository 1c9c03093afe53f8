"""Plain-torch grouped GEMM over rows sorted by expert: the CPU path and the Triton kernel's oracle.

Shapes (N rows routed to experts, E experts, K input features, M output features):
  x        [N, K]    rows sorted by expert: expert e owns rows offsets[e] .. offsets[e+1]-1
  weight   [E, M, K] one nn.Linear-layout matrix per expert
  offsets  [E + 1]   int64, offsets[0] = 0, offsets[E] <= N
  ->       [N, M]    y[i] = x[i] @ weight[expert of row i]^T; rows from offsets[E] on belong to no
                     expert here (routed to another rank) and come out zero

One batched matmul over a padded [E, C, K] layout (C = the largest group), not a loop over experts.
Reading C costs one device read, which is why CUDA takes the Triton kernel instead.
"""

from __future__ import annotations

import torch


def grouped_gemm_ref(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    num_rows, num_experts = x.shape[0], weight.shape[0]
    if num_rows == 0:
        return x.new_zeros(0, weight.shape[1])
    # The left-out rows form one more group, of zero weights.
    weight = torch.cat((weight, weight.new_zeros(1, *weight.shape[1:])))
    offsets = torch.cat((offsets, offsets.new_full((1,), num_rows)))
    num_experts += 1
    counts = offsets[1:] - offsets[:-1]
    expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts, output_size=num_rows)
    slot = torch.arange(num_rows, device=x.device) - offsets[:-1][expert]
    capacity = int(counts.max())
    padded = x.new_zeros(num_experts, capacity, x.shape[1])
    padded[expert, slot] = x
    out = torch.bmm(padded, weight.transpose(1, 2))  # [E, C, M]
    return out[expert, slot]
