"""Paged attention: the Triton kernel against the plain-torch reference, and the reference against a naive loop.

The kernel runs interpreted on CPU everywhere, and compiled on CUDA where a GPU exists (see conftest.py).
Sizes are small because the interpreter executes every tile op in numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mtpserve.kernels.paged_attention_ref import paged_attention_ref
from mtpserve.kernels.store_kv_ref import store_kv_ref

# Written into every cache slot a request does not own or has not filled yet (unused table entries
# point at a block full of it). Finite, because the reference multiplies masked probabilities (0) by V.
POISON = 1.0e4

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                self.max_query_len, self.max_seq_len, self.scale)

    def to(self, device: torch.device) -> "Batch":
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        if self.q.stride(0) != self.q.shape[1] * self.q.shape[2]:  # keep the strided view strided
            fused = torch.zeros(self.q.shape[0], self.q.stride(0), dtype=self.q.dtype, device=device)
            moved["q"] = fused[:, : self.q.shape[1] * self.q.shape[2]].view(self.q.shape)
            moved["q"].copy_(self.q)
        return Batch(**moved)


def make_batch(ctx_lens, q_lens, *, heads, kv_heads, head_dim, page, dtype, seed, strided_q=False) -> Batch:
    """Requests with ctx_lens[r] cached positions and q_lens[r] new queries, in a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks = [-(-s // page) for s in seq_lens]
    num_blocks = sum(blocks) + 3  # spare blocks nobody owns
    poison_block = num_blocks
    physical = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(blocks) + 1), poison_block, dtype=torch.int32)
    shape = (num_blocks + 1, page, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    k_cache[poison_block] = POISON
    v_cache[poison_block] = POISON
    used = 0
    for r, (s, nb) in enumerate(zip(seq_lens, blocks)):
        table[r, :nb] = physical[used : used + nb].int()
        used += nb
        if s % page:  # the tail of the last block is stale
            k_cache[table[r, nb - 1], s % page :] = POISON
            v_cache[table[r, nb - 1], s % page :] = POISON
    num_tokens = sum(q_lens)
    if strided_q:  # q as a slice of a fused projection output, as the model produces it
        fused = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
        q = fused[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    else:
        q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return Batch(
        q=q.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=0.9 / head_dim**0.5,
    )


def naive_attention(b: Batch) -> torch.Tensor:
    """One query at a time in float64: softmax over the request's gathered context up to its position."""
    num_tokens, heads, head_dim = b.q.shape
    page, kv_heads = b.k_cache.shape[1], b.k_cache.shape[2]
    out = torch.zeros(num_tokens, heads, head_dim, dtype=torch.float64)
    for r in range(b.seq_lens.shape[0]):
        seq_len = int(b.seq_lens[r])
        first, last = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1])
        k = torch.stack([b.k_cache[b.block_tables[r, p // page], p % page] for p in range(seq_len)]).double()
        v = torch.stack([b.v_cache[b.block_tables[r, p // page], p % page] for p in range(seq_len)]).double()
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [S, H, D]: query head h reads KV head h // group
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        for i in range(last - first):
            pos = seq_len - (last - first) + i
            scores = torch.einsum("hd,nhd->hn", b.q[first + i].double(), k[: pos + 1]) * b.scale
            out[first + i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v[: pos + 1])
    return out


# (context before this step, queries this step) per request, plus the head layout.
CASES = {
    # long prefill chunks on top of cached context, beside verify windows, some crossing block edges
    "mixed-g1": dict(ctx=[0, 45, 16, 31, 70, 5], q=[37, 1, 3, 5, 29, 2], heads=2, kv_heads=2, head_dim=32, page=16),
    "mixed-g2-page32": dict(ctx=[33, 0, 64, 7], q=[4, 53, 1, 66], heads=4, kv_heads=2, head_dim=64, page=32),
    "mixed-g4-page8": dict(ctx=[0, 23, 9, 40], q=[19, 5, 2, 31], heads=4, kv_heads=1, head_dim=16, page=8),
    "mixed-g8-d128": dict(ctx=[17, 0, 50], q=[3, 41, 1], heads=8, kv_heads=1, head_dim=128, page=16),
    "group3-padded": dict(ctx=[12, 0, 31], q=[5, 27, 1], heads=6, kv_heads=2, head_dim=32, page=16),
    "verify-only": dict(ctx=[1, 15, 16, 17, 63, 64, 100, 9], q=[1, 2, 3, 4, 5, 6, 1, 5],
                        heads=4, kv_heads=2, head_dim=64, page=16),
    "empty-request": dict(ctx=[10, 0, 4], q=[0, 9, 3], heads=2, kv_heads=1, head_dim=16, page=16),
}
SMALL_TILES = dict(block_m=16, block_n=16)  # more query blocks and KV tiles per request than the defaults


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tiles", [{}, SMALL_TILES], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case, tiles, dtype):
    spec = CASES[case]
    b = make_batch(spec["ctx"], spec["q"], heads=spec["heads"], kv_heads=spec["kv_heads"],
                   head_dim=spec["head_dim"], page=spec["page"], dtype=dtype, seed=list(CASES).index(case),
                   strided_q=case == "mixed-g1").to(kernels.device)
    out = kernels.paged_attention(*b.args(), **tiles)
    ref = paged_attention_ref(*b.args())
    assert out.dtype == dtype and out.shape == b.q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_n", [32, 128])
def test_kernel_matches_reference_with_other_tiles(kernels, block_n):
    """The tiles the one-pass kernel takes past one wave (32) and for verify windows of a wave (128)."""
    spec = CASES["verify-only"]
    # contexts across 128-position tile boundaries, at the head size the 128 tile is taken for
    ctx, q, head_dim = (spec["ctx"], spec["q"], spec["head_dim"]) if block_n == 32 else \
        ([127, 128, 129, 300], [4, 4, 2, 5], 128)
    b = make_batch(ctx, q, heads=spec["heads"], kv_heads=spec["kv_heads"], head_dim=head_dim,
                   page=spec["page"], dtype=torch.bfloat16, seed=3).to(kernels.device)
    torch.testing.assert_close(kernels.paged_attention(*b.args(), block_n=block_n), paged_attention_ref(*b.args()),
                               atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


def test_one_pass_tile_fits_its_programs_in_one_wave():
    from mtpserve.kernels.paged_attention import one_pass_block_n

    assert one_pass_block_n(32, 8, 128, sm_count=132) == 64  # 256 programs: one wave of 64-position tiles
    assert one_pass_block_n(64, 8, 128, sm_count=132) == 32  # 512 > 3 x 132: smaller tiles, all resident
    assert one_pass_block_n(64, 8, 64, sm_count=132) == 64  # half the head: twice the programs per SM fit
    assert one_pass_block_n(1, 1, 256, sm_count=132) == 32  # wide heads always take the small tile
    # verify windows filling at most two waves: 128-position tiles, where the shared memory holds them
    assert one_pass_block_n(32, 8, 128, sm_count=132, window=4) == 128
    assert one_pass_block_n(32, 8, 128, sm_count=132, window=4, shared_memory=100 << 10) == 64
    assert one_pass_block_n(40, 8, 128, sm_count=132, window=4) == 64  # 320 programs: past two waves
    assert one_pass_block_n(32, 8, 128, sm_count=132, window=17) == 64  # a prefill chunk, not a window


def test_kernel_fp16(kernels):
    b = make_batch([20, 0, 3], [4, 33, 1], heads=4, kv_heads=2, head_dim=64, page=16,
                   dtype=torch.float16, seed=5).to(kernels.device)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(kernels.paged_attention(*b.args()), paged_attention_ref(*b.args()), atol=tol, rtol=tol)


def test_kernel_long_prefill(kernels):
    """A thousand-token chunk spans many query blocks and KV tiles; a verify window rides along."""
    b = make_batch([13, 200], [1100, 3], heads=2, kv_heads=1, head_dim=16, page=32,
                   dtype=torch.float32, seed=11).to(kernels.device)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(kernels.paged_attention(*b.args()), paged_attention_ref(*b.args()), atol=tol, rtol=tol)


def test_kernel_empty_batch(kernels):
    b = make_batch([4], [1], heads=2, kv_heads=1, head_dim=16, page=8, dtype=torch.float32, seed=0).to(kernels.device)
    empty = b.q[:0]
    qsl = torch.zeros(1, dtype=torch.int32, device=kernels.device)
    none = torch.zeros(0, dtype=torch.int32, device=kernels.device)
    out = kernels.paged_attention(empty, b.k_cache, b.v_cache, qsl, none, b.block_tables[:0], 0, 0, b.scale)
    assert out.shape == (0, 2, 16)


def test_kernel_rejects_mismatched_dtypes(kernels):
    b = make_batch([4], [1], heads=2, kv_heads=1, head_dim=16, page=8, dtype=torch.float32, seed=0).to(kernels.device)
    with pytest.raises(ValueError):
        kernels.paged_attention(b.q.bfloat16(), *b.args()[1:])


def test_kernel_serves_steps_after_store_kv(kernels):
    """Prefill in two chunks, then verify windows: each step writes its K/V, then attends, both by kernel."""
    heads, kv_heads, head_dim, page = 4, 2, 32, 8
    gen = torch.Generator().manual_seed(3)
    pool_shape = (12, page, kv_heads, head_dim)
    table = torch.randperm(12, generator=gen)[:10].int().view(1, 10)  # one request, shuffled blocks
    k_pool, v_pool = torch.zeros(pool_shape), torch.zeros(pool_shape)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    dev = kernels.device
    k_pool, v_pool, table_dev = k_pool.to(dev), v_pool.to(dev), table.to(dev)
    seq_len = 0
    for step_len in [23, 18, 4, 1, 6]:
        positions = torch.arange(seq_len, seq_len + step_len)
        slots = (table[0, positions // page].long() * page + positions % page)
        q = torch.randn(step_len, heads, head_dim, generator=gen)
        k = torch.randn(step_len, kv_heads, head_dim, generator=gen)
        v = torch.randn(step_len, kv_heads, head_dim, generator=gen)
        seq_len += step_len
        qsl = torch.tensor([0, step_len], dtype=torch.int32)
        lens = torch.tensor([seq_len], dtype=torch.int32)
        store_kv_ref(k, v, k_ref, v_ref, slots)
        expected = paged_attention_ref(q, k_ref, v_ref, qsl, lens, table, step_len, seq_len, 0.2)
        kernels.store_kv(k.to(dev), v.to(dev), k_pool, v_pool, slots.to(dev))
        out = kernels.paged_attention(q.to(dev), k_pool, v_pool, qsl.to(dev), lens.to(dev), table_dev,
                                      step_len, seq_len, 0.2)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive_loop(case, dtype):
    spec = CASES[case]
    b = make_batch(spec["ctx"], spec["q"], heads=spec["heads"], kv_heads=spec["kv_heads"],
                   head_dim=spec["head_dim"], page=spec["page"], dtype=dtype, seed=list(CASES).index(case))
    ref = paged_attention_ref(*b.args())
    tol = TOLERANCE[dtype]  # the reference computes in fp32 and rounds its output to the input dtype
    torch.testing.assert_close(ref.double(), naive_attention(b), atol=tol, rtol=tol)
