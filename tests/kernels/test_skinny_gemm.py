"""skinny_gemm: the Triton small-M GEMM against the plain-torch reference (interpreted on CPU; compiled on
CUDA where a GPU exists, see conftest.py): odd M, N and K not multiples of the tiles, fp32 and bf16,
with and without split-K and bias, and the config helpers' invariants."""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.skinny_gemm_ref import skinny_gemm_ref

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    expected = skinny_gemm_ref(x, w, b)
    assert out.dtype == x.dtype and out.shape == expected.shape
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


# (M, N, K, config as (block_n, block_k, split, warps, stages) or None for the default)
CASES = {
    "m1-default": (1, 96, 128, None),
    "m5-odd-n-odd-k": (5, 50, 100, (32, 32, 1, 4, 1)),
    "m16-split2": (16, 64, 256, (32, 32, 2, 4, 1)),
    "m17-split3-ragged-k": (17, 33, 200, (16, 32, 3, 4, 1)),
    "m33-split4-uneven": (33, 40, 96, (16, 16, 4, 4, 1)),  # 6 K tiles in splits of 2: only 3 splits run
    "m70-two-m-tiles": (70, 24, 48, (16, 16, 2, 4, 1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case, dtype):
    run_case(kernels, case, dtype, bias=False)


@pytest.mark.parametrize("case", ["m5-odd-n-odd-k", "m17-split3-ragged-k"])  # the bias in each epilogue
def test_bias(kernels, case):
    run_case(kernels, case, torch.bfloat16, bias=True)


def run_case(kernels, case: str, dtype: torch.dtype, bias: bool) -> None:
    from mtpserve.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

    m, n, k, cfg = CASES[case]
    x, w, b = make_case(m, n, k, dtype, bias, seed=list(CASES).index(case))
    dev = kernels.device
    out = skinny_gemm(x.to(dev), w.to(dev), None if b is None else b.to(dev),
                      None if cfg is None else SkinnyConfig(*cfg))
    check(out, x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["m16-split2", "m17-split3-ragged-k", "m33-split4-uneven", "m70-two-m-tiles"])
def test_a_fused_split_sum_gives_the_second_kernels_bits(kernels, case, dtype):
    """Each tile's last split program sums its partials in split order, as _sum_splits_kernel does: the same bits,
    and the arrival counters are back at zero for the next product (a CUDA graph replays them as they are)."""
    from mtpserve.kernels import skinny_gemm as sg

    m, n, k, cfg = CASES[case]
    x, w, b = make_case(m, n, k, dtype, True, seed=list(CASES).index(case))
    dev = kernels.device
    x, w, b = x.to(dev), w.to(dev), b.to(dev)
    apart = sg.skinny_gemm(x, w, b, sg.SkinnyConfig(*cfg))
    for _ in range(2):  # the second call finds the counters the first one left
        fused = sg.skinny_gemm(x, w, b, sg.SkinnyConfig(*cfg, fused=True))
        assert torch.equal(fused, apart)
    assert int(sg._counters[x.device].abs().sum()) == 0
    check(fused.cpu(), x.cpu(), w.cpu(), b.cpu())


def test_a_fused_split_sum_too_wide_for_the_counters_takes_the_second_kernel(kernels, monkeypatch):
    from mtpserve.kernels import skinny_gemm as sg

    m, n, k, cfg = CASES["m16-split2"]  # 64 outputs in strips of 32: 2 tiles
    x, w, _ = make_case(m, n, k, torch.float32, False, seed=3)
    dev = kernels.device
    monkeypatch.setattr(sg, "COUNTERS", 1)
    launched = []
    monkeypatch.setattr(sg, "_sum_splits_kernel", _Recording(sg._sum_splits_kernel, launched))
    check(sg.skinny_gemm(x.to(dev), w.to(dev), config=sg.SkinnyConfig(*cfg, fused=True)).cpu(), x, w, None)
    assert len(launched) == 1


class _Recording:
    """A kernel whose launches are counted (kernel[grid](...) as Triton's)."""

    def __init__(self, kernel, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


def test_strided_rows_of_x(kernels):
    """x may be a row-strided view (a slice of a wider activation), as long as K is contiguous."""
    from mtpserve.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

    x, w, _ = make_case(9, 40, 64, torch.float32, False, seed=7)
    wide = torch.zeros(9, 100)
    wide[:, 10:74] = x
    dev = kernels.device
    out = skinny_gemm(wide.to(dev)[:, 10:74], w.to(dev), config=SkinnyConfig(16, 32, 2, 4, 1))
    check(out, x, w, None)


def test_refuses_mismatched_operands(kernels):
    from mtpserve.kernels.skinny_gemm import skinny_gemm

    dev = kernels.device
    x, w, _ = make_case(2, 16, 32, torch.float32, False, seed=1)
    with pytest.raises(ValueError, match="disagree"):
        skinny_gemm(x.to(dev), w[:, :16].contiguous().to(dev))
    with pytest.raises(ValueError, match="disagree"):
        skinny_gemm(x.to(dev), w.to(torch.bfloat16).to(dev))
    with pytest.raises(ValueError, match="unit stride"):
        skinny_gemm(x.to(dev), w.t().contiguous().t().to(dev))


def test_empty_rows(kernels):
    from mtpserve.kernels.skinny_gemm import skinny_gemm

    x, w, _ = make_case(0, 16, 32, torch.float32, False, seed=2)
    assert skinny_gemm(x.to(kernels.device), w.to(kernels.device)).shape == (0, 16)


def test_an_empty_inner_dimension_gives_the_bias(kernels):
    from mtpserve.kernels.skinny_gemm import skinny_gemm

    dev = kernels.device
    x, w, b = torch.ones(3, 0, device=dev), torch.ones(5, 0, device=dev), torch.arange(5.0, device=dev)
    assert torch.equal(skinny_gemm(x, w), torch.zeros(3, 5, device=dev))
    assert torch.equal(skinny_gemm(x, w, b), b.expand(3, 5))


def test_split_fills_the_sms_and_keeps_k_tiles():
    from mtpserve.kernels.skinny_gemm import TILES, block_m, candidate_configs, m_bucket, split_for

    assert [block_m(m) for m in (1, 16, 17, 33, 64, 200)] == [16, 16, 32, 64, 64, 64]
    assert [m_bucket(m) for m in (1, 16, 17, 33, 65, 256)] == [16, 16, 32, 64, 128, 256]
    # 4096 outputs in strips of 64 = 64 programs: split 2 gives 128 < 132 SMs, so 4; strips of 32: 2
    assert split_for(1, 4096, 4096, 64, 128, 132) == 4
    assert split_for(1, 4096, 4096, 32, 256, 132) == 2
    assert split_for(1, 128256, 4096, 64, 128, 132) == 1  # the LM head fills the GPU by itself
    assert split_for(1, 64, 256, 64, 128, 132) == 1  # too few K tiles to cut
    configs = candidate_configs(1, 4096, 4096, 132)
    assert len(configs) == len(set(configs)) <= 7 * len(TILES)  # each shape measures them all at start-up
    # each split comes with its sum fused and apart; no split has nothing to sum
    assert {c for c in configs if c.split > 1} == {c.__class__(*c.as_list()[:5], fused=f) for c in configs
                                                  if c.split > 1 for f in (False, True)}
    assert not any(c.fused for c in configs if c.split == 1)
    # 8: twice the 4 that fills the SMs with strips of 64; 2: half of it (the down projection's best, H100)
    assert {c.split for c in configs if c.block_n == 64 and c.block_k == 128} == {1, 2, 4, 8}
    assert {c.split for c in configs if c.block_n == 32} == {1, 2, 4}  # a fill of 2 has no half but 1
    assert {c.split for c in candidate_configs(1, 128256, 4096, 132)} == {1}

