"""store_kv: the Triton kernel against the plain-torch reference, and the reference against a naive loop.

The kernel runs interpreted on CPU everywhere, and compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.store_kv_ref import store_kv_ref


def make_case(num_tokens, kv_heads, head_dim, page, *, src_dtype, cache_dtype, seed, strided=False, skip_every=3):
    """Random rows, distinct random slots in a pool of spare capacity, every skip_every-th row skipped."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // page) + 2
    if strided:  # key/value as slices of a fused QKV projection output, as the model produces them
        fused = torch.randn(num_tokens, (2 + 2 * kv_heads) * head_dim + 8, generator=gen)
        width = kv_heads * head_dim
        key = fused[:, 2 * head_dim : 2 * head_dim + width].view(num_tokens, kv_heads, head_dim)
        value = fused[:, 2 * head_dim + width : 2 * head_dim + 2 * width].view(num_tokens, kv_heads, head_dim)
    else:
        key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
        value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    return key.to(src_dtype), value.to(src_dtype), k_cache, v_cache, slots


CASES = {
    "fp32": dict(num_tokens=29, kv_heads=2, head_dim=64, page=16, src_dtype=torch.float32, cache_dtype=torch.float32),
    "bf16": dict(num_tokens=17, kv_heads=4, head_dim=128, page=32, src_dtype=torch.bfloat16,
                 cache_dtype=torch.bfloat16),
    "fp32-into-bf16": dict(num_tokens=11, kv_heads=1, head_dim=32, page=8, src_dtype=torch.float32,
                           cache_dtype=torch.bfloat16),
    "odd-heads-and-dim": dict(num_tokens=13, kv_heads=3, head_dim=24, page=16, src_dtype=torch.float16,
                              cache_dtype=torch.float16),
    "strided-rows": dict(num_tokens=9, kv_heads=2, head_dim=16, page=8, src_dtype=torch.float32,
                         cache_dtype=torch.float32, strided=True),
    "heads-split-over-programs": dict(num_tokens=3, kv_heads=40, head_dim=128, page=8, src_dtype=torch.float32,
                                      cache_dtype=torch.float32),
    "no-skips-int32-slots": dict(num_tokens=7, kv_heads=2, head_dim=32, page=16, src_dtype=torch.float32,
                                 cache_dtype=torch.float32, skip_every=0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case):
    spec = dict(CASES[case])
    key, value, k_cache, v_cache, slots = make_case(**spec, seed=list(CASES).index(case))
    if case == "no-skips-int32-slots":
        slots = slots.int()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots.long())
    dev = kernels.device
    if spec.get("strided"):
        # .to(device) would make the views contiguous; rebuild the same strided layout there.
        fused_k = torch.empty(key.shape[0], key.stride(0), dtype=key.dtype, device=dev)
        fused_v = torch.empty(value.shape[0], value.stride(0), dtype=value.dtype, device=dev)
        key_d = fused_k[:, : key[0].numel()].view(key.shape)
        value_d = fused_v[:, : value[0].numel()].view(value.shape)
        key_d.copy_(key)
        value_d.copy_(value)
        assert not key_d.is_contiguous()
    else:
        key_d, value_d = key.to(dev), value.to(dev)
    k_out, v_out = k_cache.to(dev), v_cache.to(dev)
    kernels.store_kv(key_d, value_d, k_out, v_out, slots.to(dev))
    # A copy with a cast: bit-exact, including the untouched slots.
    torch.testing.assert_close(k_out.cpu(), k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_out.cpu(), v_ref, atol=0, rtol=0)


def test_kernel_all_skipped_and_empty(kernels):
    key, value, k_cache, v_cache, slots = make_case(5, 2, 16, 8, src_dtype=torch.float32,
                                                    cache_dtype=torch.float32, seed=9, skip_every=1)
    dev = kernels.device
    k_out, v_out = k_cache.to(dev), v_cache.to(dev)
    kernels.store_kv(key.to(dev), value.to(dev), k_out, v_out, slots.to(dev))
    kernels.store_kv(key[:0].to(dev), value[:0].to(dev), k_out, v_out, slots[:0].to(dev))
    assert torch.equal(k_out.cpu(), k_cache) and torch.equal(v_out.cpu(), v_cache)


def test_kernel_rejects_mismatched_shapes(kernels):
    key, value, k_cache, v_cache, slots = make_case(4, 2, 16, 8, src_dtype=torch.float32,
                                                    cache_dtype=torch.float32, seed=1)
    dev = kernels.device
    with pytest.raises(ValueError):
        kernels.store_kv(key[:, :1].to(dev), value[:, :1].to(dev), k_cache.to(dev), v_cache.to(dev), slots.to(dev))


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive_loop(case):
    key, value, k_cache, v_cache, slots = make_case(**CASES[case], seed=list(CASES).index(case))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    page = k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // page, slot % page] = key[t].to(k_cache.dtype)
            v_cache[slot // page, slot % page] = value[t].to(v_cache.dtype)
    assert torch.equal(k_ref, k_cache) and torch.equal(v_ref, v_cache)
