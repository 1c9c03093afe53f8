"""The dense (teacher-forced) forward of the target decoder and its MTP modules, and the DeepSeek-V3 MTP objective.

It runs [B, S] batches through F.scaled_dot_product_attention instead of the paged KV cache (training has no
cache), calling the very sub-layers and parameters of TargetModel and MTPStack, so a trained model is served by
loader.load_model unchanged (tests/workers/test_train.py checks that both paths give the same logits), and tests
use it as the teacher-forced reference of the MTP KV caches.

Head j (0 = target, j = k+1 = MTP module k) at position i predicts t_{i+j+1} (docs/design.md §3):
module k consumes g^{k-1}_i (g^{-1} = target hidden) and Emb(t_{i+k+1}).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.layers import DecoderLayer
from mtpserve.workers.models.mtp import MTPStack

IGNORE = -100


# --- dense forward over the serving modules' parameters --------------------------------------


def dense_layer(layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """x [B, S, H], positions [S] -> [B, S, H]; same math as DecoderLayer.forward, causal over each row."""
    attn = layer.self_attn
    b, s, _ = x.shape
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(b, s, attn.num_heads, attn.head_dim)
    k = k.view(b, s, attn.num_kv_heads, attn.head_dim)
    v = v.view(b, s, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    # The rotary table is indexed by positions [S] and broadcasts over the batch dimension.
    q, k = attn.rotary(q, positions), attn.rotary(k, positions)
    # Query head j reads KV head j // group, as in paged_attention_ref; repeating the KV heads
    # (instead of enable_gqa) keeps every SDPA backend, flash included, available.
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    # The fp32 norms/rotary lift q and k to fp32 under autocast; bring them back to v's dtype so
    # SDPA can use the flash kernel.
    dtype = v.dtype
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    out = attn.o_proj(out.transpose(1, 2).reshape(b, s, q_size))
    x = x + F.dropout(out, dropout, training=dropout > 0)
    return x + F.dropout(layer.mlp(layer.post_attention_layernorm(x)), dropout, training=dropout > 0)


def target_hidden(target: TargetModel, tokens: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """tokens [B, S] -> hidden states before the final norm [B, S, H] (what TargetModel.forward returns)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = target.embed_tokens(tokens)
    for layer in target.layers:
        x = dense_layer(layer, x, positions, dropout)
    return x


def mtp_module_hidden(
    mtp: MTPStack,
    k: int,
    token_ids: torch.Tensor,
    prev_hidden: torch.Tensor,
    embed: nn.Embedding,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Module k over [B, S]: token_ids carry t_{i+k+1}, prev_hidden g^{k-1}_i -> g^k [B, S, H] (MTPStack.forward)."""
    module = mtp.mtp[k]
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)
    emb = (module.embed_tokens or embed)(token_ids)
    if mtp.cfg.mtp.mask_position0:
        emb = emb.masked_fill((positions == 0)[None, :, None], 0.0)
    e, h = module.enorm(emb), module.hnorm(prev_hidden)
    x = module.eh_proj(torch.cat((h, e) if mtp.cfg.mtp.hidden_first else (e, h), dim=-1))
    return dense_layer(module.block, x, positions, dropout)


def shift(tokens: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    """[B, S] -> [B, S] with out[:, i] = tokens[:, i + n]; the last n columns are `pad`."""
    out = tokens.new_full(tokens.shape, pad)
    if n < tokens.shape[1]:
        out[:, : tokens.shape[1] - n] = tokens[:, n:]
    return out


def dense_forward(target: TargetModel, mtp: MTPStack, tokens: torch.Tensor, dropout: float = 0.0) -> list[torch.Tensor]:
    """tokens [B, S] -> fp32 logits [B, S, V] per head: [target, module 0, ...]; head j predicts t_{i+j+1}.

    Module k's inputs past the end of the row are padding; causal attention keeps them from
    touching valid positions and the loss ignores them.
    """
    h = target_hidden(target, tokens, dropout)
    logits = [target.logits(h)]
    prev = h if mtp.cfg.mtp.hidden_pre_norm else target.norm(h)
    for k in range(len(mtp)):
        g = mtp_module_hidden(mtp, k, shift(tokens, k + 1, 0), prev, target.embed_tokens, dropout)
        logits.append(mtp.logits(k, g, target.lm_head))
        prev = mtp.next_hidden(k, g)
    return logits


def head_targets(tokens: torch.Tensor, head: int) -> torch.Tensor:
    return shift(tokens, head + 1, IGNORE)


def mtp_objective(
    logits: list[torch.Tensor], tokens: torch.Tensor, mtp_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: CE_main + lambda * mean_k CE_k. Returns (loss, per-head CE [1 + L], detached)."""
    ces = torch.stack(
        [F.cross_entropy(lg.flatten(0, 1), head_targets(tokens, j).flatten(), ignore_index=IGNORE) for j, lg in enumerate(logits)]
    )
    loss = ces[0] + (mtp_lambda * ces[1:].mean() if len(logits) > 1 else 0.0)
    return loss, ces.detach()
