"""Tensor parallelism as a pass over the loaded, unsharded model (as gpt-fast does it).

The model code knows nothing of ranks: `shard_model` swaps a rank's slice into each linear and wraps
the ones whose outputs must be summed or gathered, Megatron style:

* qkv_proj (fused q|k|v) and gate_up_proj (fused gate|up): column-parallel, each segment sliced by
  heads (or by intermediate units) so the fused layouts stay valid per rank;
* o_proj and down_proj: row-parallel, partial sums all-reduced (bias added once, after the sum);
* token embedding: vocabulary-parallel (each rank looks up its rows, zeros elsewhere, all-reduce);
* MoE blocks: expert-parallel (mtpserve/workers/expert_parallel.py), one all-reduce per block;
* output head: column-parallel over the vocabulary, then all-gathered, so every rank holds the same
  full logits (bit for bit: each slice comes from exactly one rank). Sampling from them with the
  counter-based RNG gives every rank the same tokens, which keeps all ranks' bookkeeping identical.

FP8 linears (models/fp8_linear.py) stay FP8 where a rank's rows or columns are whole quantisation
blocks, and are dequantised where they are not.

Attention modules get per-rank head counts, so the KV pools a rank allocates hold only its KV heads
(latent attention splits its query heads; every rank keeps the whole one-"head" latent pool).
Collectives run on the tensor-parallel group: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.fp8_linear import FP8Linear, dequantized, fp8_cols, fp8_rows
from mtpserve.workers.models.layers import MLP, DecoderLayer
from mtpserve.workers.models.mtp import MTPStack


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world: int
    group: dist.ProcessGroup | None  # None: the default group is the tensor-parallel group


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError naming the first model dimension that `world` ranks cannot split evenly."""
    if cfg.moe is not None:
        from mtpserve.workers.expert_parallel import check_expert_parallel

        check_expert_parallel(cfg.moe.num_experts, cfg.moe.num_shared_experts * cfg.moe.intermediate_size, world)
    # Latent attention keeps its one-"head" latent whole on every rank; only query heads split.
    kv_heads = () if cfg.mla is not None else (("num_key_value_heads", cfg.num_kv_heads),)
    for name, value in (("num_attention_heads", cfg.num_heads), *kv_heads, ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size: {world} does not divide this model's {name} ({value})")


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[n, c] per rank -> [n, world * c], rank order along the last dimension."""
    parts = [torch.empty_like(x) for _ in range(tp.world)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ bias once): the input arrives split along its features."""

    def __init__(self, linear: nn.Module, cols: torch.Tensor, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.part = partial_product(linear, cols)
        self.bias = None if linear.bias is None else _param(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.part(x), self.tp)
        return y if self.bias is None else y + self.bias


def partial_product(linear: nn.Module, cols: torch.Tensor) -> nn.Module:
    """x_cols -> x_cols @ W[:, cols]^T, no bias (a rank's share of a row-parallel product); FP8 stays FP8
    when cols are whole blocks."""
    if isinstance(linear, FP8Linear):
        part = fp8_cols(linear, cols)
        if part is not None:
            return part
        linear = dequantized(linear)
    out = nn.Linear(len(cols), linear.out_features, bias=False, device="meta")
    out.weight = _param(linear.weight[:, cols.to(linear.weight.device)])
    return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + per_rank) of the table; ids elsewhere look up zeros and come from their owner."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab = tp, weight.shape[0]
        self.per_rank = -(-self.vocab // tp.world)
        self.start = tp.rank * self.per_rank
        self.weight = _param(_vocab_slice(weight, self.start, self.per_rank))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0.0), self.tp)


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary slice, all-gathered into the full [n, vocab] on every rank."""

    def __init__(self, weight: nn.Parameter, vocab: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.weight = weight  # the embedding's shard when the checkpoint ties them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(F.linear(x, self.weight), self.tp)[:, : self.vocab]


def shard_model(target: TargetModel, mtp: MTPStack | None, tp: TPGroup,
                fetch: Callable[[str], None] | None = None, device: torch.device | None = None) -> None:
    """Shard in place: the target's layers, embedding and head, and (when given) every MTP module.

    With `fetch`, the model may still be on the meta device: fetch(prefix) loads the parameters under
    that prefix ("layers.3.", "embed_tokens.", "mtp.0.", ...) just before their part is sharded, and
    each part moves to `device` right after, so only one unsharded part at a time is ever in memory.
    """
    check_shardable(target.cfg, tp.world)
    fetch = fetch or (lambda prefix: None)

    def place(module: nn.Module) -> nn.Module:
        return module.to(device) if device is not None else module

    for i, layer in enumerate(target.layers):
        fetch(f"layers.{i}.")
        _shard_layer(layer, tp)
        place(layer)
    fetch("embed_tokens.")
    tied = target.lm_head.weight is target.embed_tokens.weight
    target.embed_tokens = place(VocabParallelEmbedding(target.embed_tokens.weight, tp))
    if not tied:
        fetch("lm_head.")
    target.lm_head = place(_head(target.lm_head, target.embed_tokens if tied else None, tp))
    fetch("norm.")
    place(target.norm)
    for k, module in enumerate(mtp.mtp if mtp is not None else []):
        fetch(f"mtp.{k}.")
        _shard_layer(module.block, tp)  # eh_proj and the norms stay replicated: small, and need full rows
        if module.embed_tokens is not None:
            module.embed_tokens = VocabParallelEmbedding(module.embed_tokens.weight, tp)
        if module.head is not None:
            module.head = _head(module.head, None, tp)
        place(module)


def _shard_layer(layer: DecoderLayer, tp: TPGroup) -> None:
    attn, mlp, w, r = layer.self_attn, layer.mlp, tp.world, tp.rank
    if hasattr(attn, "kv_b_proj"):
        _shard_latent_attention(attn, tp)
    else:
        heads, kv_heads, d = attn.num_heads // w, attn.num_kv_heads // w, attn.head_dim
        q_rows = _block(r, heads * d)
        k_rows = attn.num_heads * d + _block(r, kv_heads * d)
        v_rows = (attn.num_heads + attn.num_kv_heads) * d + _block(r, kv_heads * d)
        attn.qkv_proj = _column(attn.qkv_proj, torch.cat((q_rows, k_rows, v_rows)))
        attn.o_proj = RowParallelLinear(attn.o_proj, q_rows, tp)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
    if not isinstance(mlp, MLP):  # an MoE block: its experts are split over the ranks
        from mtpserve.workers.expert_parallel import ExpertParallelMoE  # it builds on this module

        layer.mlp = ExpertParallelMoE(mlp, tp)
        return
    inter = mlp.gate_up_proj.out_features // 2
    units = _block(r, inter // w)
    mlp.gate_up_proj = _column(mlp.gate_up_proj, torch.cat((units, inter + units)))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, units, tp)


def _shard_latent_attention(attn: nn.Module, tp: TPGroup) -> None:
    """MLA by query heads: q (q_proj or q_b_proj) and kv_b_proj column-parallel per head, o_proj
    row-parallel; the latent projections (q_a, kv_a) and the latent pool stay whole on every rank."""
    mla, heads = attn.mla, attn.num_heads // tp.world
    qk, kv = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    name = "q_proj" if mla.q_lora_rank is None else "q_b_proj"
    setattr(attn, name, _column(getattr(attn, name), _block(tp.rank, heads * qk)))
    attn.kv_b_proj = _column(attn.kv_b_proj, _block(tp.rank, heads * kv))
    attn.o_proj = RowParallelLinear(attn.o_proj, _block(tp.rank, heads * mla.v_head_dim), tp)
    attn.num_heads = heads


def _head(head: nn.Linear, embedding: VocabParallelEmbedding | None, tp: TPGroup) -> VocabParallelHead:
    vocab = head.out_features
    if embedding is not None:
        return VocabParallelHead(embedding.weight, vocab, tp)
    per_rank = -(-vocab // tp.world)
    return VocabParallelHead(_param(_vocab_slice(head.weight, tp.rank * per_rank, per_rank)), vocab, tp)


def _block(rank: int, size: int) -> torch.Tensor:
    return torch.arange(rank * size, (rank + 1) * size)


def _column(linear: nn.Module, rows: torch.Tensor) -> nn.Module:
    if isinstance(linear, FP8Linear):  # FP8 when the rows are whole blocks, else its dequantised rows
        return fp8_rows(linear, rows) or _column(dequantized(linear), rows)
    out = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    out.weight = _param(linear.weight[rows.to(linear.weight.device)])
    if linear.bias is not None:
        out.bias = _param(linear.bias[rows.to(linear.bias.device)])
    return out


def _vocab_slice(weight: torch.Tensor, start: int, per_rank: int) -> torch.Tensor:
    """Rows [start, start + per_rank), zero-padded past the vocabulary (the last rank's slice may be short)."""
    rows = weight[start : start + per_rank]
    if rows.shape[0] == per_rank:
        return rows
    return torch.cat((rows, rows.new_zeros(per_rank - rows.shape[0], weight.shape[1])))


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)
