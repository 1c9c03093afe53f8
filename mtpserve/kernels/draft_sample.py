"""Triton draft sampling from each row's top-M logits in one launch (drop-in for `draft_sample_ref`).

In torch a sampled draft took about fifteen kernels per chain step (tempered softmax over the vocabulary,
top-M, renormalisation, a uniform, the inverse CDF, the greedy rows' override); on small models, inside a
CUDA graph, their launches were most of a draft's cost. Here the top-M selection stays torch's topk and
one program per row does the rest, drawing its uniform itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpserve.kernels.counter_uniforms import counter_uniform
from mtpserve.kernels.counter_uniforms_ref import GOLDEN, M1, M2


@triton.jit(do_not_specialize=["m"])
def _draft_sample_kernel(values_ptr, ids_ptr, temperature_ptr, greedy_ptr, seed_ptr, index_ptr, token_ptr, probs_ptr,
                         m, stride_v, stride_i, stream, golden, m1, m2, BLOCK_M: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_M)
    ok = j < m
    x = tl.load(values_ptr + b * stride_v + j, mask=ok, other=float("-inf")).to(tl.float32)
    x = x / tl.load(temperature_ptr + b)
    e = tl.where(ok, tl.exp(x - tl.max(x, 0)), 0.0)
    probs = e / tl.sum(e, 0)
    tl.store(probs_ptr + b * m + j, probs, mask=ok)
    cdf = tl.cumsum(probs, 0)
    u = counter_uniform(tl.load(seed_ptr + b), tl.load(index_ptr + b), stream, golden, m1, m2)
    target = u * tl.sum(tl.where(j == m - 1, cdf, 0.0), 0)
    pick = tl.minimum(tl.sum(((cdf <= target) & ok).to(tl.int32), 0), m - 1)
    ids = tl.load(ids_ptr + b * stride_i + j, mask=ok, other=0)
    chosen = tl.sum(tl.where(j == pick, ids, 0), 0)
    first = tl.sum(tl.where(j == 0, ids, 0), 0)
    tl.store(token_ptr + b, tl.where(tl.load(greedy_ptr + b) != 0, first, chosen))


def draft_sample(
    values: torch.Tensor,  # [B, M] float, unit stride along M
    ids: torch.Tensor,  # [B, M] int64
    temperature: torch.Tensor,  # [B] float32
    greedy: torch.Tensor,  # [B] bool
    seed: torch.Tensor,  # [B] int64
    index: torch.Tensor,  # [B] int64
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> token [B] int64, probs [B, M] float32 (see draft_sample_ref)."""
    batch, m = values.shape
    if ids.shape != values.shape or not (temperature.shape == greedy.shape == seed.shape == index.shape == (batch,)):
        raise ValueError(f"ids {tuple(ids.shape)} must match values {tuple(values.shape)}, and temperature, greedy, "
                         f"seed and index be [{batch}]")
    if seed.dtype != torch.int64 or index.dtype != torch.int64 or temperature.dtype != torch.float32:
        raise ValueError(f"seed and index must be int64 and temperature float32, got {seed.dtype}, {index.dtype}, "
                         f"{temperature.dtype}")
    token = torch.empty(batch, dtype=torch.int64, device=values.device)
    probs = torch.empty(batch, m, dtype=torch.float32, device=values.device)
    if batch == 0 or m == 0:
        return token, probs
    values, ids = (t if t.stride(1) == 1 else t.contiguous() for t in (values, ids))
    _draft_sample_kernel[(batch,)](values, ids, temperature, greedy.view(torch.int8), seed, index, token, probs,
                                   m, values.stride(0), ids.stride(0), stream, GOLDEN, M1, M2,
                                   BLOCK_M=triton.next_power_of_2(m), num_warps=1)
    return token, probs
