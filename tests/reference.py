"""An independent plain-torch reference of the target decoder and the MTP modules (docs/design.md §3).

Its own RMSNorm, RoPE, causal GQA attention and SwiGLU, with every weight read straight from
model.safetensors by its checkpoint name: nothing of mtpserve's layers, config parsing or weight maps.
Teacher forcing over tokens t_0 .. t_{S-1}: module 0 gets (h_i, t_{i+1}); module k gets
(g^{k-1}_i, t_{i+k+1}); logits^k = Head_k(norm_k(g^k_i)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


@dataclass(frozen=True)
class Wiring:
    layout: str  # "deepseek" or "mimo"
    hidden_pre_norm: bool  # module 0 gets the target hidden before the final norm
    hidden_first: bool  # eh_proj input is cat(hidden, emb) instead of cat(emb, hidden)
    pass_normed: bool  # module k+1 gets norm_k(g^k) instead of g^k
    mask_position0: bool = True


DEEPSEEK = Wiring("deepseek", hidden_pre_norm=False, hidden_first=False, pass_normed=False)
MIMO = Wiring("mimo", hidden_pre_norm=True, hidden_first=True, pass_normed=True)


class Reference:
    def __init__(self, path: Path) -> None:
        self.w = load_file(str(path / "model.safetensors"))
        raw = json.loads((path / "config.json").read_text())
        self.eps = raw["rms_norm_eps"]
        self.heads = raw["num_attention_heads"]
        self.kv_heads = raw["num_key_value_heads"]
        self.head_dim = raw["head_dim"]
        self.layers = raw["num_hidden_layers"]
        rope = raw.get("rope_parameters") or {}
        self.rope_type = rope.get("rope_type", "default")
        self.theta = rope.get("rope_theta", raw.get("rope_theta"))
        self.rotary_dim = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))  # the first dims turn
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w["lm_head.weight"] if "lm_head.weight" in self.w else self.embed  # tied

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.rope_type == "default", f"the reference implements default rope only, not {self.rope_type}"
        d = self.rotary_dim
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = positions.float()[:, None] * inv_freq[None, :]  # [S, d/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2: d]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., d:]), dim=-1)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return out if bias is None else out + bias

    def block(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """One decoder block (HF names under prefix p) over a whole sequence at positions 0..S-1."""
        x = x + self.attention(p + "self_attn.", self.rms(x, self.w[p + "input_layernorm.weight"]))
        return x + self.mlp(p + "mlp.", self.rms(x, self.w[p + "post_attention_layernorm.weight"]))

    def attention(self, p: str, h: torch.Tensor) -> torch.Tensor:
        """Causal GQA attention with HF names under prefix p (a subclass adds latent attention)."""
        s, d = h.shape[0], self.head_dim
        positions = torch.arange(s)
        q = self.linear(h, p + "q_proj").view(s, self.heads, d)
        k = self.linear(h, p + "k_proj").view(s, self.kv_heads, d)
        v = self.linear(h, p + "v_proj").view(s, self.kv_heads, d)
        if p + "q_norm.weight" in self.w:
            q = self.rms(q, self.w[p + "q_norm.weight"])
            k = self.rms(k, self.w[p + "k_norm.weight"])
        q, k = self.rope(q, positions), self.rope(k, positions)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return self.linear(self.causal_attention(q, k, v, 1 / math.sqrt(d)).reshape(s, -1), p + "o_proj")

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k [S, H, Dk], v [S, H, Dv] -> [S, H, Dv]."""
        s = q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP with HF names under prefix p (a subclass adds MoE blocks)."""
        return self.linear(F.silu(self.linear(h, p + "gate_proj")) * self.linear(h, p + "up_proj"), p + "down_proj")

    def target(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (pre-norm hidden, post-norm hidden, logits) over the sequence."""
        x = self.embed[tokens]
        for i in range(self.layers):
            x = self.block(f"model.layers.{i}.", x)
        post = self.rms(x, self.w["model.norm.weight"])
        return x, post, post @ self.head.T

    def mtp(self, tokens: torch.Tensor, num: int, wiring: Wiring, use_own_copies: bool = True) -> list[torch.Tensor]:
        """Teacher-forced logits of modules 0..num-1; module k's rows are positions 0..S-2-k."""
        pre, post, _ = self.target(tokens)
        prev = pre if wiring.hidden_pre_norm else post
        out = []
        for k in range(num):
            n = tokens.shape[0] - 1 - k
            logits, prev = self.module(k, tokens[k + 1 : k + 1 + n], prev[:n], wiring, use_own_copies)
            out.append(logits)
        return out

    def module(self, k: int, tokens: torch.Tensor, prev: torch.Tensor, wiring: Wiring,
               use_own_copies: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Module k over rows at positions 0..n-1 with inputs (prev[i], tokens[i]) -> (logits, hidden handed on)."""
        if wiring.layout == "deepseek":
            p = f"model.layers.{self.layers + k}."
            enorm, hnorm, proj, norm = "enorm", "hnorm", "eh_proj", "shared_head.norm"
        else:
            p = f"model.mtp_layers.{k}."
            enorm, hnorm, proj, norm = "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"
        embed = self.w.get(p + "embed_tokens.weight", self.embed) if use_own_copies else self.embed
        head = self.w.get(p + "shared_head.head.weight", self.head) if use_own_copies else self.head
        emb = embed[tokens].clone()
        if wiring.mask_position0:
            emb[0] = 0.0
        e = self.rms(emb, self.w[p + enorm + ".weight"])
        h = self.rms(prev, self.w[p + hnorm + ".weight"])
        x = torch.cat((h, e) if wiring.hidden_first else (e, h), dim=-1) @ self.w[p + proj + ".weight"].T
        g = self.block(p, x)
        normed = self.rms(g, self.w[p + norm + ".weight"])
        return normed @ head.T, (normed if wiring.pass_normed else g)
