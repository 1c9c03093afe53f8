"""Split-KV paged attention: the Triton kernels against the plain-torch reference, and the split choice.

Decode steps and verify windows of 1..9 tokens per request, odd GQA groups, contexts on and off block
boundaries, more splits than a request has tiles (empty splits), bf16 and fp32. Interpreted on CPU,
compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.paged_attention_ref import paged_attention_ref
from mtpserve.kernels.paged_attention_split import MAX_WINDOW, num_splits_for
from tests.kernels.test_paged_attention import TOLERANCE, make_batch

# (context before this step, queries this step) per request, plus the head layout.
CASES = {
    "decode-g4": dict(ctx=[0, 15, 16, 47, 130], q=[1, 1, 1, 1, 1], heads=8, kv_heads=2, head_dim=64, page=16),
    "verify-windows": dict(ctx=[3, 16, 31, 64, 95], q=[2, 4, 9, 5, 3], heads=4, kv_heads=2, head_dim=32, page=16),
    "group3-padded": dict(ctx=[12, 40, 1], q=[4, 1, 7], heads=6, kv_heads=2, head_dim=32, page=8),
    "mha-d128": dict(ctx=[77, 5], q=[3, 2], heads=2, kv_heads=2, head_dim=128, page=32),
    "empty-request": dict(ctx=[10, 20], q=[0, 3], heads=2, kv_heads=1, head_dim=16, page=16),
}


def _batch(case: str, dtype: torch.dtype, device: torch.device):
    spec = CASES[case]
    return make_batch(spec["ctx"], spec["q"], heads=spec["heads"], kv_heads=spec["kv_heads"],
                      head_dim=spec["head_dim"], page=spec["page"], dtype=dtype,
                      seed=list(CASES).index(case), strided_q=case == "verify-windows").to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3, 8], ids=["1-split", "3-splits", "8-splits"])
@pytest.mark.parametrize("case", list(CASES))
def test_split_kernel_matches_reference(kernels, case, splits, dtype):
    b = _batch(case, dtype, kernels.device)
    out = kernels.paged_attention_split(*b.args(), num_splits=splits, block_n=16)
    ref = paged_attention_ref(*b.args())
    assert out.dtype == dtype and out.shape == b.q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_split_kernel_chooses_its_own_splits(kernels):
    """Without num_splits the wrapper picks them from the batch shape; the result does not depend on it."""
    b = _batch("decode-g4", torch.float32, kernels.device)
    torch.testing.assert_close(kernels.paged_attention_split(*b.args()), paged_attention_ref(*b.args()),
                               atol=1e-5, rtol=1e-5)


def test_split_kernel_refuses_long_windows(kernels):
    b = make_batch([4], [MAX_WINDOW + 1], heads=2, kv_heads=1, head_dim=16, page=8, dtype=torch.float32,
                   seed=0).to(kernels.device)
    with pytest.raises(ValueError, match="max_query_len"):
        kernels.paged_attention_split(*b.args())


def test_split_count_fills_the_gpu_and_no_more():
    # batch 1, 8 KV heads, long context on 132 SMs: enough splits for two programs per SM
    assert num_splits_for(1, 8, 1, 8192, group=4, sm_count=132) == 33
    # a full batch already fills the GPU: no split
    assert num_splits_for(64, 8, 4, 8192, group=4, sm_count=132) == 1
    # a verify window whose programs fill the SMs once: no split; a decode step there still splits
    assert num_splits_for(32, 8, 4, 1024, group=4, sm_count=132) == 1
    assert num_splits_for(32, 8, 1, 1024, group=4, sm_count=132) == 2
    # a short context caps the splits at two tiles each
    assert num_splits_for(1, 8, 1, 256, group=4, sm_count=132) == 2
    # prefill chunks and windows past one M tile take the one-pass kernel
    assert num_splits_for(1, 8, MAX_WINDOW + 1, 8192, group=4, sm_count=132) == 1
    assert num_splits_for(1, 1, 16, 8192, group=16, sm_count=132) == 1
