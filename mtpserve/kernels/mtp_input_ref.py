"""Reference input of an MTP module: the rows eh_proj reads, cat(enorm(Emb(t)), hnorm(g)) in the architecture's order.

The composition of the embedding lookup, the position-0 mask, the shift of the hidden rows onto the
module's window (mtp_input_rows) and two rms_norm_ref calls; the CPU path and the Triton kernel's oracle.
  token_ids     [B, Q] int64, any strides (row b, column i: the token of row b * Q + i)
  positions     [B * Q] int64
  embed         [V, H] the embedding table, in the model dtype (here also the embedding module itself:
                a vocabulary-parallel one looks its rows up with an all-reduce)
  prev_hidden   [B, P, H]; P >= Q, or P >= Q - 1 with first_hidden
  first_hidden  None (row (b, i) takes prev_hidden[b, i]) or [B, H]: row (b, 0) takes first_hidden[b],
                row (b, i >= 1) takes prev_hidden[b, i - 1]
  enorm_weight, hnorm_weight  [H]
  mask_position0  zero the embedding of rows at position 0 (the first token has no predecessor)
  hidden_first    hnorm's half first (else enorm's)
  -> [B * Q, 2 * H]
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.kernels.rmsnorm_ref import rms_norm_ref


def mtp_input_rows(token_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor | nn.Module,
                   prev_hidden: torch.Tensor, first_hidden: torch.Tensor | None, mask_position0: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the two norms take: (embeddings [B * Q, H], hidden rows [B * Q, H])."""
    batch, q = token_ids.shape
    ids = token_ids.reshape(-1)
    emb = embed(ids) if isinstance(embed, nn.Module) else embed[ids]  # [B * Q, H]
    if mask_position0:
        emb = emb.masked_fill((positions == 0)[:, None], 0.0)
    if first_hidden is None:
        hidden = prev_hidden[:, :q]
    else:
        hidden = torch.cat((first_hidden[:, None], prev_hidden[:, : q - 1]), 1)
    return emb, hidden.reshape(batch * q, prev_hidden.shape[-1])


def mtp_input_ref(token_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor | nn.Module,
                  prev_hidden: torch.Tensor,
                  first_hidden: torch.Tensor | None, enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float,
                  mask_position0: bool, hidden_first: bool) -> torch.Tensor:
    emb, hidden = mtp_input_rows(token_ids, positions, embed, prev_hidden, first_hidden, mask_position0)
    e, h = rms_norm_ref(emb, enorm_weight, eps), rms_norm_ref(hidden, hnorm_weight, eps)
    return torch.cat((h, e) if hidden_first else (e, h), dim=-1)
