"""Plain-torch attention over a paged KV cache for a flat batch: the CPU path and the kernels' oracle.

Shapes (T tokens in the batch, R requests, H query heads, Hkv KV heads, D head size):
  q              [T, H, D]        queries of all requests, concatenated
  k_cache/v_cache[NB, BS, Hkv, D] the pool; block b holds positions b*BS .. b*BS+BS-1 of its owner
  query_start_loc[R + 1] int32    request r's queries are q[qsl[r]:qsl[r+1]]
  seq_lens       [R] int32        context length of request r, this step's tokens included
  block_tables   [R, MB] int32    physical block of each logical block
Query i of request r sits at position seq_lens[r] - qlen[r] + i and attends to positions <= its own.
"""

from __future__ import annotations

import torch


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    device = q.device

    # Gather each request's context into a padded [R, S, Hkv, D] view.
    pos = torch.arange(max_seq_len, device=device)
    blocks = block_tables[:, pos // block_size].long()
    slots = blocks * block_size + pos % block_size
    k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots]
    v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots]

    # Scatter the flat queries into a padded [R, Qmax, H, D] layout.
    qlens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=device), qlens, output_size=num_tokens)
    idx_in_req = torch.arange(num_tokens, device=device) - query_start_loc[:-1].long()[req_of_token]
    q_pad = q.new_zeros(num_reqs, max_query_len, num_heads, head_dim)
    q_pad[req_of_token, idx_in_req] = q

    # Causal mask by absolute position; padded keys (>= seq_len) are never visible.
    q_pos = (seq_lens.long() - qlens)[:, None] + torch.arange(max_query_len, device=device)[None, :]
    visible = pos[None, None, :] <= q_pos[:, :, None]  # [R, Qmax, S]

    # GQA: [R, Hkv, group*Qmax, D] against [R, Hkv, S, D].
    qg = q_pad.view(num_reqs, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_reqs, num_kv_heads, group * max_query_len, head_dim)
    scores = torch.matmul(qg.float(), k.permute(0, 2, 3, 1).float()) * scale  # [R, Hkv, G*Qmax, S]
    mask = visible[:, None, None, :, :].expand(-1, num_kv_heads, group, -1, -1)
    scores = scores.masked_fill(~mask.reshape(num_reqs, num_kv_heads, group * max_query_len, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # fully masked padding rows -> 0
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())  # [R, Hkv, G*Qmax, D]
    out = out.view(num_reqs, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_reqs, max_query_len, num_heads, head_dim)
    return out[req_of_token, idx_in_req].to(q.dtype)
