"""Reference row argmax: the index of each row's largest entry, the first one where several tie.

  x    [R, V] float (logits of a verify window's rows, or a draft position's)
  ->   [R] int64
"""

from __future__ import annotations

import torch


def row_argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
