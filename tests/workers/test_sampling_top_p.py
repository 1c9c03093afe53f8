"""Top-p by a probability threshold (sampling._top_p_threshold, by sort or by bisection) against the sort
of the prefix it replaced.

The sort oracle below is the code to_probs used before: keep the smallest sorted prefix whose mass
reaches top_p. The threshold keeps every token >= the crossing token's probability, so the two agree
on rows where the crossing token has no tie; with ties at the threshold the threshold keeps all the
tied tokens (FlashInfer's and vLLM's rule), which the sort cut at an arbitrary one of them. top_p is
always put halfway up a step of the row's mass staircase, so float rounding cannot move the crossing.
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers import sampling
from mtpserve.workers.sampling import SamplingTensors, _top_p_threshold, to_probs


@pytest.fixture(autouse=True, params=["sort", "bisection"])
def threshold_method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with both ways to the threshold, whatever the vocabulary (they must agree)."""
    monkeypatch.setattr(sampling, "BISECT_MIN_VOCAB", 1 << 62 if request.param == "sort" else 0)
    monkeypatch.setattr(sampling, "BISECT_ON_CUDA", request.param == "bisection")
    return request.param


def _settings(top_p: torch.Tensor, temperature: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
              min_p: torch.Tensor | None = None, vocab: int = 0, top_k_cap: int | None = None) -> SamplingTensors:
    """Rows [B] with only the given filters on (top-p always)."""
    b, dev = top_p.shape[0], top_p.device
    ones, zeros = torch.ones(b, device=dev), torch.zeros(b, device=dev)
    return SamplingTensors(
        temperature=ones if temperature is None else temperature,
        top_k=torch.full((b,), vocab, device=dev) if top_k is None else top_k, top_p=top_p,
        min_p=zeros if min_p is None else min_p, repetition=ones, presence=zeros, frequency=zeros,
        greedy=torch.zeros(b, dtype=torch.bool, device=dev), seed=torch.zeros(b, dtype=torch.long, device=dev),
        use_penalties=False, use_top_k=top_k is not None, use_top_p=True, use_min_p=min_p is not None,
        all_greedy=False, top_k_cap=top_k_cap,
    )


def _sort_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The oracle: the former sort-based top-p of to_probs -> the dropped tokens [B, V] bool."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    return drop_sorted.scatter(1, order, drop_sorted)


def _before_top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """What top-p sees in to_probs (temperature, top-k by a sort, softmax), bit for bit, unnormalised."""
    logits = logits / st.temperature[:, None]
    if st.use_top_k:
        k = st.top_k.clamp(max=logits.shape[-1])[:, None]  # top_k >= V: off
        logits = logits.masked_fill(logits < logits.sort(-1, descending=True).values.gather(1, k - 1), float("-inf"))
    return logits.softmax(-1)


def _oracle_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """to_probs with the sort oracle, in to_probs' order: temperature, top-k, softmax, top-p, min-p."""
    probs = _before_top_p(logits, st)
    probs = probs.masked_fill(_sort_drop(probs, st.top_p), 0.0)
    if st.use_min_p:
        probs = probs.masked_fill(probs < st.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _kept_by_definition(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rule as stated, brute force in float64 (small V): t = the largest value whose tokens at or
    above it hold mass >= top_p (0 if none does) -> kept [B, V] = probs >= t."""
    p = probs.double()
    mass_at_or_above = (p[:, None, :] * (p[:, None, :] >= p[:, :, None])).sum(-1)  # [B, V], per token's value
    t = p.masked_fill(mass_at_or_above < top_p[:, None].double(), 0.0).amax(-1, keepdim=True)
    return p >= t


def _mid_step_top_p(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """probs [B, V] -> top_p [B] halfway up a random step of each row's mass staircase (the mass at or
    above each distinct value), on a step at least 4e-6 tall whose value stands clear of the next one."""
    out = []
    for row in probs.double().sort(-1, descending=True).values:
        ends = torch.nonzero(row > torch.cat((row[1:], row.new_zeros(1)))).flatten()  # last of each tie group
        levels = torch.cat((row.new_zeros(1), row.cumsum(0)[ends]))
        step, value = levels.diff(), row[ends]
        clear = value > torch.cat((value[1:], row.new_zeros(1))) * (1 + 1e-5)
        ok = torch.nonzero((step > 4e-6) & clear).flatten()
        j = ok[torch.randint(len(ok), (1,), generator=gen)]
        out.append(levels[j] + step[j] / 2)
    return torch.cat(out).float()


def _logits(b: int, v: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    scale = {"peaked": 6.0, "flat": 0.05, "mixed": 2.0}[kind]
    return torch.randn(b, v, generator=gen) * scale


SHAPES = [(1, 1), (3, 1), (4, 2), (5, 7), (3, 33), (8, 1001), (2, 4097)]


@pytest.mark.parametrize("kind", ["peaked", "flat", "mixed"])
@pytest.mark.parametrize("b,v", SHAPES)
def test_kept_set_equals_the_sort_oracle(b: int, v: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(b * 7919 + v)
    probs = _logits(b, v, kind, gen).softmax(-1)
    top_p = _mid_step_top_p(probs, gen)
    t = _top_p_threshold(probs, top_p)
    assert t.shape == (b, 1)
    assert torch.equal(probs >= t, ~_sort_drop(probs, top_p))
    assert (probs == t).any(-1).all()  # t is the crossing token's own probability, found exactly


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_kept_set_equals_the_sort_oracle_at_a_151936_vocabulary(kind: str) -> None:
    gen = torch.Generator().manual_seed(151936)
    logits = _logits(2, 151936, kind, gen)
    st = _settings(_mid_step_top_p(logits.softmax(-1), gen))
    got, want = to_probs(logits, st), _oracle_to_probs(logits, st)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("b,v", SHAPES)
def test_to_probs_matches_the_sort_oracle(b: int, v: int) -> None:
    gen = torch.Generator().manual_seed(v)
    logits = _logits(b, v, "mixed", gen)
    st = _settings(_mid_step_top_p(logits.softmax(-1), gen))
    got, want = to_probs(logits, st), _oracle_to_probs(logits, st)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_every_token_tied_with_the_crossing_one_is_kept() -> None:
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])
    out = to_probs(probs.log(), _settings(torch.tensor([0.6])))  # the crossing is at the second 0.2
    torch.testing.assert_close(out, torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.0]]) / 0.9)
    assert _sort_drop(probs, torch.tensor([0.6])).sum() == 2  # the sort cut one tied 0.2 (and the 0.1)


def test_a_prefix_reaching_top_p_exactly_is_enough() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])  # binary fractions: the sums are exact
    kept = probs >= _top_p_threshold(probs, torch.tensor([0.75]))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.equal(kept, ~_sort_drop(probs, torch.tensor([0.75])))


@pytest.mark.parametrize("seed", range(4))
def test_rows_with_many_ties_follow_the_rule(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.randint(0, 4, (6, 40), generator=gen).float().exp()  # 4 distinct values: ties everywhere
    probs /= probs.sum(-1, keepdim=True)
    top_p = _mid_step_top_p(probs, gen)
    assert torch.equal(probs >= _top_p_threshold(probs, top_p), _kept_by_definition(probs, top_p))


def test_bf16_logits_tie_often_and_follow_the_rule() -> None:
    gen = torch.Generator().manual_seed(16)
    logits = (torch.randn(4, 50, generator=gen) * 3).bfloat16()  # 8-bit mantissas: equal logits are common
    probs = logits.float().softmax(-1)  # to_probs' temperature division promotes to float32 first
    top_p = _mid_step_top_p(probs, gen)
    assert torch.equal(to_probs(logits, _settings(top_p)) > 0, _kept_by_definition(probs, top_p))


def test_top_p_one_rows_keep_everything_beside_filtered_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = _logits(4, 300, "peaked", gen)
    top_p = _mid_step_top_p(logits.softmax(-1), gen)
    top_p[0] = top_p[2] = 1.0
    st = _settings(top_p)
    out = to_probs(logits, st)
    torch.testing.assert_close(out[[0, 2]], logits[[0, 2]].softmax(-1))
    torch.testing.assert_close(out, _oracle_to_probs(logits, st))
    assert (out[[1, 3]] == 0).any(-1).all()  # the other rows did drop tokens


def test_rows_that_keep_everything() -> None:
    # [0]: top_p 1, though the first two tokens already sum to 1.0 in float32;
    # [1]: the row's mass (0.5) falls short of top_p; [2]: a padding row's top_p of 0.
    probs = torch.tensor([[0.5, 0.5, 1e-9], [0.2, 0.2, 0.1], [0.7, 0.2, 0.1]])
    t = _top_p_threshold(probs, torch.tensor([1.0, 0.9, 0.0]))
    assert (probs >= t).all()  # t is 0 by bisection, the row's least probability by sort
    assert not _sort_drop(probs[1:2], torch.tensor([0.9])).any()  # the sort kept the short row whole too


CONFIGS = {
    "temperature": dict(temperature=torch.tensor([0.7, 1.3, 1.0, 2.0])),
    "top_k": dict(top_k=torch.tensor([5, 200, 50, 1]), top_k_cap=256),
    "min_p": dict(min_p=torch.tensor([0.05, 0.0, 0.2, 0.01])),
    "all": dict(temperature=torch.tensor([0.7, 1.3, 1.0, 2.0]), top_k=torch.tensor([40, 200, 200, 3]),
                min_p=torch.tensor([0.05, 0.0, 0.1, 0.01]), top_k_cap=256),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_top_p_with_temperature_top_k_and_min_p_matches_the_oracle(config: str) -> None:
    gen = torch.Generator().manual_seed(len(config))
    logits = _logits(4, 200, "mixed", gen)
    st = _settings(torch.ones(4), **CONFIGS[config], vocab=200)
    st.top_p = _mid_step_top_p(_before_top_p(logits, st), gen)
    got, want = to_probs(logits, st), _oracle_to_probs(logits, st)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_no_data_dependent_shapes_or_host_reads() -> None:
    # Meta tensors have no data: .item(), .tolist(), bool(tensor) and boolean-mask indexing all raise.
    meta = torch.device("meta")
    st = _settings(torch.empty(8, device=meta), min_p=torch.empty(8, device=meta),
                   top_k=torch.empty(8, dtype=torch.long, device=meta), top_k_cap=64)
    assert to_probs(torch.empty(8, 1000, device=meta), st).shape == (8, 1000)
    assert _top_p_threshold(torch.empty(8, 1000, device=meta), st.top_p).shape == (8, 1)
    with pytest.raises(RuntimeError):
        torch.empty(2, device=meta).sum().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_without_a_host_sync_and_inside_a_cuda_graph() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = _logits(8, 151936, "mixed", gen).cuda()
    probs = logits.softmax(-1).cpu()  # what to_probs filters on the GPU (temperature 1), bit for bit
    top_p = _mid_step_top_p(probs, gen)
    st = _settings(top_p.cuda())  # built before the sync check: copies to the GPU wait
    want = to_probs(logits, st)
    assert torch.equal(want.cpu() > 0, ~_sort_drop(probs, top_p))
    torch.cuda.set_sync_debug_mode("error")  # a host sync inside to_probs now raises
    try:
        got = to_probs(logits, st)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = to_probs(logits, st)
    graph.replay()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(captured, want)
