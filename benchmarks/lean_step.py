"""The same-run lean reference of step_benchmark.py: plain PyTorch steps of the same shapes.

A verify step of `window` tokens per request over the target's own weights, with a dense KV cache
[B, Hkv, context + window, D] per layer, SDPA attention and one CUDA graph for the whole step; and a
draft step: one MTP module (its block over one row per request, with its own dense KV) plus the LM
head and an argmax. Nothing here is paged, sampled or scheduled: it is what a step of these shapes
costs when it does only the arithmetic. mtpserve's step is reported as a ratio against it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mtpserve.workers.models.layers import DecoderLayer
from mtpserve.workers.models.loader import LoadedModel


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class _DenseLayer:
    """One decoder layer over [B, w] tokens with a dense cache of `context` earlier positions."""

    def __init__(self, layer: DecoderLayer, batch: int, context: int, window: int, eps: float) -> None:
        attn = layer.self_attn
        self.layer, self.eps, self.context, self.window = layer, eps, context, window
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        w = attn.qkv_proj.weight
        shape = (batch, self.kv_heads, context + window, self.head_dim)
        self.k = torch.randn(shape, dtype=w.dtype, device=w.device) * 0.1
        self.v = torch.randn(shape, dtype=w.dtype, device=w.device) * 0.1
        # Query i sits at position context + i and sees every position up to its own.
        keys = torch.arange(context + window, device=w.device)
        self.mask = keys[None, :] <= context + torch.arange(window, device=w.device)[:, None] if window > 1 else None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        layer, attn, (b, w, _) = self.layer, self.layer.self_attn, x.shape
        h = _rms(x, layer.input_layernorm.weight, self.eps)
        q, k, v = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = _rope(q.view(b, w, self.heads, self.head_dim), cos, sin).transpose(1, 2)
        self.k[:, :, self.context:] = _rope(k.view(b, w, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        self.v[:, :, self.context:] = v.view(b, w, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=self.mask, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, w, -1), attn.o_proj.weight)
        gate, up = F.linear(_rms(x, layer.post_attention_layernorm.weight, self.eps), layer.mlp.gate_up_proj.weight
                            ).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)


class LeanStep:
    """verify(window) or draft (one MTP module + head) of a fixed batch, as one CUDA graph."""

    def __init__(self, model: LoadedModel, batch: int, context: int, window: int, draft: bool) -> None:
        target, cfg = model.target, model.config
        dev, eps = target.embed_tokens.weight.device, cfg.rms_norm_eps
        self.model, self.draft = model, draft
        blocks = [model.mtp.mtp[0].block] if draft else list(target.layers)
        self.layers = [_DenseLayer(block, batch, context, window, eps) for block in blocks]
        positions = context + torch.arange(window, device=dev)
        self.cos, self.sin = target.rotary.cos[positions][:, None], target.rotary.sin[positions][:, None]
        self.ids = torch.randint(0, cfg.vocab_size, (batch, window), device=dev)
        self.hidden = torch.randn(batch, window, cfg.hidden_size, dtype=target.embed_tokens.weight.dtype, device=dev)
        self.eps = eps
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        target, x = self.model.target, self.model.target.embed_tokens(self.ids)
        if self.draft:
            mod = self.model.mtp.mtp[0]
            x = F.linear(torch.cat((_rms(x, mod.enorm.weight, self.eps), _rms(self.hidden, mod.hnorm.weight, self.eps)),
                                   dim=-1), mod.eh_proj.weight)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        norm = self.model.mtp.mtp[0].norm.weight if self.draft else target.norm.weight
        return F.linear(_rms(x, norm, self.eps), target.lm_head.weight).argmax(-1)

    def runner(self) -> Callable[[], None]:
        """A callable that runs one step: a graph replay on CUDA, the eager forward elsewhere."""
        if not self.ids.is_cuda:
            return self.forward
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.forward()
        return self.graph.replay
