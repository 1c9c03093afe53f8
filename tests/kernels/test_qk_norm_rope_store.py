"""qk_norm_rope_store: the Triton kernel against the composition of the torch references it replaces.

Qwen3-style q/k norm with full and partial rotary, no norm (Llama), odd head counts, q/k/v sliced out
of a fused QKV output, skipped slots, fp32 and bf16. Interpreted on CPU, compiled on CUDA where a GPU
exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.qk_norm_rope_store_ref import qk_norm_rope_store_ref
from mtpserve.workers.models.config import RopeConfig
from mtpserve.workers.models.layers import RotaryEmbedding

# fp32: the norm's sum runs in another order; bf16: a unit or two in the last place (the interpreter
# truncates fp32 -> bf16 where the GPU rounds).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
PAGE = 4


def _case(heads: int, kv_heads: int, head_dim: int, rot: int, norm: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim + 5, generator=gen).to(dtype)  # padded: strided
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim : (heads + 2 * kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    weights = [(1.0 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)] if norm else [None, None]
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), rot, 64)
    positions = torch.tensor([0, 3, 5, 17, 33, 62, 63])
    slots = torch.tensor([0, 5, -1, 9, 2, -1, 11])
    cache = torch.randn(4, PAGE, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, weights, rotary.cos, rotary.sin, positions, cache, slots


CASES = {
    "qwen3-fp32": (4, 2, 64, 64, True, torch.float32),
    "qwen3-bf16": (4, 2, 64, 64, True, torch.bfloat16),
    "partial-rotary-norm": (4, 2, 64, 32, True, torch.float32),
    "no-norm-bf16": (8, 2, 32, 32, False, torch.bfloat16),
    "odd-heads": (6, 3, 32, 32, True, torch.float32),
    "partial-rotary-odd-rest": (3, 1, 48, 32, True, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_unfused_references(kernels, case):
    from mtpserve.kernels.qk_norm_rope_store import qk_norm_rope_store

    heads, kv_heads, head_dim, rot, norm, dtype = CASES[case]
    q, k, v, (qw, kw), cos, sin, positions, cache, slots = _case(*CASES[case], seed=list(CASES).index(case))
    k_ref, v_ref = cache.clone(), cache.clone()
    want = qk_norm_rope_store_ref(q, k, v, qw, kw, 1e-6, cos, sin, positions, k_ref, v_ref, slots)
    dev = kernels.device
    fused = torch.empty(q.shape[0], q.stride(0), dtype=dtype, device=dev)  # keep the strided layout on the device
    fused.copy_(q.as_strided((q.shape[0], q.stride(0)), (q.stride(0), 1)))
    width = heads * head_dim
    q_d = fused[:, :width].view(q.shape)
    k_d = fused[:, width : width + kv_heads * head_dim].view(k.shape)
    v_d = fused[:, width + kv_heads * head_dim : width + 2 * kv_heads * head_dim].view(v.shape)
    assert not q_d.is_contiguous()
    k_out, v_out = cache.clone().to(dev), cache.clone().to(dev)  # .to(cpu) would alias them
    got = qk_norm_rope_store(q_d, k_d, v_d, qw.to(dev) if norm else None, kw.to(dev) if norm else None, 1e-6,
                             cos.to(dev), sin.to(dev), positions.to(dev), k_out, v_out, slots.to(dev))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(k_out.cpu(), k_ref, atol=tol, rtol=tol)
    assert torch.equal(v_out.cpu(), v_ref)  # v is copied, not computed
    untouched = torch.ones(cache.shape[0] * PAGE, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    flat = k_out.cpu().view(-1, kv_heads, head_dim)
    assert torch.equal(flat[untouched], cache.view(-1, kv_heads, head_dim)[untouched])  # skipped slots stay


def test_kernel_rejects_mismatched_inputs(kernels):
    from mtpserve.kernels.qk_norm_rope_store import qk_norm_rope_store

    q, k, v, (qw, kw), cos, sin, positions, cache, slots = (
        x.to(kernels.device) if isinstance(x, torch.Tensor) else x for x in _case(4, 2, 32, 32, True, torch.float32, 1))
    qw, kw = qw.to(kernels.device), kw.to(kernels.device)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope_store(q, k, v, qw, None, 1e-6, cos, sin, positions, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, positions[:3], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="do not fit"):
        qk_norm_rope_store(q, k[:, :1], v, qw, kw, 1e-6, cos, sin, positions, cache, cache.clone(), slots)
