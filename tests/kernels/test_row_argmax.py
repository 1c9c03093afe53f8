"""row_argmax: the split-vocabulary Triton argmax against torch.argmax (interpreted on CPU, compiled on
CUDA where a GPU exists, see conftest.py): ties inside a block and across blocks go to the first index,
rows of -inf, strided rows, bf16 and fp32, vocabularies that are not a multiple of the block."""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.row_argmax_ref import row_argmax_ref


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,vocab", [(1, 3), (1, 5000), (7, 1024), (33, 2051), (4, 9000)])
def test_matches_torch(kernels, rows, vocab, dtype):
    from mtpserve.kernels.row_argmax import row_argmax

    x = _logits(rows, vocab, dtype, seed=rows * vocab)
    got = row_argmax(x.to(kernels.device))
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), row_argmax_ref(x))


def test_ties_go_to_the_first_index(kernels):
    """bf16 logits tie often: greedy output must equal torch's (and the k = 0 path's) choice."""
    from mtpserve.kernels.row_argmax import MIN_BLOCK, row_argmax

    x = _logits(4, 3 * MIN_BLOCK + 5, torch.bfloat16, seed=3)
    top = x.max() + 1
    x[0, 5] = x[0, 7] = top  # inside one block
    x[1, 2 * MIN_BLOCK + 1] = x[1, MIN_BLOCK + 9] = top  # across blocks: the earlier block wins
    x[2] = top  # every entry ties
    x[3] = float("-inf")  # nothing finite
    got = row_argmax(x.to(kernels.device)).cpu()
    assert got.tolist() == [5, MIN_BLOCK + 9, 0, 0] == row_argmax_ref(x).tolist()


def test_strided_rows_and_bad_input(kernels):
    from mtpserve.kernels.row_argmax import row_argmax

    wide = _logits(5, 3000, torch.float32, seed=9)
    view = wide.to(kernels.device)[:, 100:2600]  # rows 3000 apart, unit stride along V
    assert torch.equal(row_argmax(view).cpu(), row_argmax_ref(wide[:, 100:2600]))
    assert row_argmax(torch.empty(0, 10, device=kernels.device)).shape == (0,)
    with pytest.raises(ValueError, match="unit stride"):
        row_argmax(wide.to(kernels.device).t())
    with pytest.raises(ValueError, match="columns"):
        row_argmax(torch.empty(2, 0, device=kernels.device))


def test_block_size_fills_the_sms():
    from mtpserve.kernels.row_argmax import MAX_BLOCK, MIN_BLOCK, block_size

    # one row of 128256: 528 programs wanted, blocks of 1024 give 126; 128 rows: 8192-wide, 16 a row
    assert block_size(1, 128256, 132) == MIN_BLOCK
    assert block_size(128, 128256, 132) == MAX_BLOCK
    assert block_size(8, 128256, 132) == 2048  # 66 programs a row wanted: 63 blocks of 2048
