"""Reference greedy verification: how many of a request's drafts equal the target's argmax at their position.

  drafts      [B, k] int64   the drafts verified this step
  argmax      [B, k + 1] int64  the target's argmax at each window row (row j predicts the token after draft j - 1)
  num_drafts  [B] int64      drafts the request verifies (its row's later drafts are padding)
  -> accepted [B] int64: the length of the run of drafts from the first that equal the argmax, within num_drafts
"""

from __future__ import annotations

import torch


def greedy_accept_ref(drafts: torch.Tensor, argmax: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    k = drafts.shape[1]
    accept = (drafts == argmax[:, :k]) & (torch.arange(k, device=drafts.device) < num_drafts[:, None])
    return accept.cumprod(dim=1).sum(dim=1)
