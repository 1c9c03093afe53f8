"""Reference draft sampling from a row's top-M logits, under temperature alone (docs/design.md §4).

The drafter's proposal q' is the request's sampling distribution truncated to its M most likely tokens and
renormalised. With temperature as the only transform that is softmax(top-M logits / T): the softmax's
normaliser over the whole vocabulary cancels in the renormalisation, so nothing but the top M is read.
  values       [B, M] float   each row's top M logits (any order; ids alongside)
  ids          [B, M] int64
  temperature  [B] float32    1 on greedy rows
  greedy       [B] bool       these rows draft ids[:, 0] (the top logit, as topk orders them)
  seed, index  [B] int64      the counter-based uniform of (seed, index) in `stream` picks the token
  -> token [B] int64, probs [B, M] float32 (q' over ids)
"""

from __future__ import annotations

import torch

from mtpserve.kernels.counter_uniforms_ref import counter_uniforms_ref


def draft_sample_ref(values: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                     seed: torch.Tensor, index: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(values.float() / temperature[:, None].float(), dim=-1)
    cdf = probs.cumsum(-1)
    target = counter_uniforms_ref(seed, index, stream) * cdf[:, -1]
    pick = (cdf <= target[:, None]).sum(-1).clamp(max=probs.shape[-1] - 1)  # inverse CDF (searchsorted, right)
    return torch.where(greedy, ids[:, 0], ids.gather(1, pick[:, None])[:, 0]), probs
