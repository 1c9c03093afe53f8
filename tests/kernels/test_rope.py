"""RoPE: the Triton kernel against the torch reference, and the reference against the model's rotary.

Full and partial rotary (GLM-4.5), odd head counts, q and k sliced out of a fused QKV output, fp32 and
bf16. Interpreted on CPU, compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.rope_ref import rope_ref
from mtpserve.workers.models.config import RopeConfig
from mtpserve.workers.models.layers import RotaryEmbedding

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}  # bf16: a unit or two in the last place


def _tables(rot: int, positions: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), rot, positions)
    return rotary.cos, rotary.sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,head_dim,rot", [(4, 64, 64), (6, 32, 32), (3, 64, 32)],
                         ids=["full", "odd-heads", "partial"])
def test_rope_matches_reference(kernels, heads, head_dim, rot, dtype):
    from mtpserve.kernels.rope import rope

    gen = torch.Generator().manual_seed(heads * head_dim + rot)
    kv_heads = 2
    qkv = torch.randn(7, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(kernels.device)
    q = qkv[:, : heads * head_dim].view(7, heads, head_dim)  # strided, as the model slices it
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(7, kv_heads, head_dim)
    cos, sin = (t.to(kernels.device) for t in _tables(rot))
    positions = torch.tensor([0, 1, 5, 17, 33, 62, 63], device=kernels.device)
    tol = TOLERANCE[dtype]
    for x in (q, k):
        out = rope(x, cos, sin, positions)
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out, rope_ref(x, cos, sin, positions), atol=tol, rtol=tol)


def test_rope_refuses_tables_wider_than_the_head(kernels):
    from mtpserve.kernels.rope import rope

    cos, sin = (t.to(kernels.device) for t in _tables(64))
    x = torch.zeros(2, 2, 32, device=kernels.device)
    with pytest.raises(ValueError, match="cos/sin"):
        rope(x, cos, sin, torch.zeros(2, dtype=torch.long, device=kernels.device))


def test_reference_is_the_models_rotary():
    """rope_ref computes exactly what RotaryEmbedding does on CPU (full and partial rotary)."""
    for head_dim, rot in ((64, 64), (64, 32)):
        rotary = RotaryEmbedding(RopeConfig(theta=500000.0), rot, 128)
        x = torch.randn(5, 3, head_dim)
        positions = torch.tensor([0, 3, 64, 100, 127])
        assert torch.equal(rope_ref(x, rotary.cos, rotary.sin, positions), rotary(x, positions))
