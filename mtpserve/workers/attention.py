"""Attention over the paged KV cache for a flat batch: metadata and backend dispatch.

On CUDA the Triton kernels run; elsewhere their plain-torch references do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.kernels import use_fused
from mtpserve.kernels.paged_attention_ref import paged_attention_ref
from mtpserve.kernels.store_kv_ref import store_kv_ref


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flat batch and where its KV lives (one KV group)."""

    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int


@dataclass
class LayerKV:
    """One attention layer's K and V pools, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Write this step's K/V ([T, Hkv, D]) into the pool, then attend with q ([T, H, D]) -> [T, H, D]."""
    if q.is_cuda:
        from mtpserve.kernels.store_kv import store_kv
    else:
        store_kv = store_kv_ref
    store_kv(k, v, kv.k, kv.v, meta.slot_mapping)
    return attend_stored(q, kv, meta, scale)


def attend_stored(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attend with q ([T, H, D]) over a pool that already holds this step's K/V -> [T, H, D]."""
    paged_attention = _cuda_attention(q, kv, meta) if q.is_cuda else paged_attention_ref
    return paged_attention(
        q, kv.k, kv.v, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.max_query_len, meta.max_seq_len, scale,
    )


def attend_latent(q: torch.Tensor, entry: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
                  value_dim: int) -> torch.Tensor:
    """Multi-head latent attention over a one-"head" pool: write this step's entries ([T, 1, E]) once, then
    attend with q ([T, H, E]) against every entry as the key and its first `value_dim` dims as the value
    -> [T, H, value_dim]. kv.k is kv.v: the same pool serves as both.

    The attention itself is the plain-torch reference on every device for now (a latent-space Triton
    kernel for E = kv_lora_rank + rope dims is not written yet)."""
    if entry.is_cuda:  # the Triton store skips negative slots without a host sync; K and V are one pool
        from mtpserve.kernels.store_kv import store_kv

        store_kv(entry, entry, kv.k, kv.v, meta.slot_mapping)
    else:
        store_kv_ref(entry, entry, kv.k, kv.v, meta.slot_mapping)
    out = paged_attention_ref(
        q, kv.k, kv.k, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.max_query_len, meta.max_seq_len, scale,
    )
    return out[..., :value_dim]


def _cuda_attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata):
    """Split-KV while (requests x KV heads) programs would leave SMs idle (decode, verify windows);
    the one-pass kernel otherwise. Decided from host-side shapes only, so a graph keeps its choice."""
    from mtpserve.kernels.paged_attention import paged_attention
    from mtpserve.kernels.paged_attention_split import num_splits_for, paged_attention_split, sm_count

    if not use_fused(q):
        return paged_attention
    num_kv_heads = kv.k.shape[2]
    splits = num_splits_for(meta.seq_lens.shape[0], num_kv_heads, meta.max_query_len, meta.max_seq_len,
                            q.shape[1] // num_kv_heads, sm_count(q.device))
    return paged_attention_split if splits > 1 else paged_attention
