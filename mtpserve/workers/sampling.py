"""The request's sampling transform, applied identically to target and draft logits (docs/design.md §4).

All functions are batched over rows [B, V]; per-row settings are tensors, never Python loops.
Randomness is counter-based: a uniform is a hash of (seed, token index, stream), so a seeded request
samples the same tokens whatever else is in the batch, and drawing never advances shared state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.kernels import use_fused
from mtpserve.kernels.counter_uniforms_ref import counter_uniforms_ref
from mtpserve.kernels.draft_sample_ref import draft_sample_ref

# Streams keep the draws of one token index independent of each other.
STREAM_DRAFT, STREAM_ACCEPT, STREAM_SAMPLE = 1, 2, 3


def uniforms(seed: torch.Tensor, index: torch.Tensor, stream: int) -> torch.Tensor:
    """seed, index: int64 tensors (broadcastable) -> float32 uniforms in [0, 1) of their broadcast shape: the
    same bits on every device (kernels/counter_uniforms_ref.py), in one kernel on CUDA."""
    if use_fused(seed):
        from mtpserve.kernels.counter_uniforms import counter_uniforms

        return counter_uniforms(seed, index, stream)
    return counter_uniforms_ref(seed, index, stream)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, the first index of each row's maximum (torch.argmax); on CUDA a
    split-vocabulary kernel that spreads a few rows over every SM (kernels/row_argmax.py)."""
    if use_fused(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        from mtpserve.kernels.paged_attention import sm_count
        from mtpserve.kernels.row_argmax import row_argmax

        return row_argmax(logits, sm_count(logits.device))
    return logits.argmax(-1)


@dataclass
class SamplingTensors:
    """Per-row settings on the device; flags are host-side so unused filters cost nothing."""

    temperature: torch.Tensor  # [B] float, 1.0 on greedy rows
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    repetition: torch.Tensor  # [B] float
    presence: torch.Tensor  # [B] float
    frequency: torch.Tensor  # [B] float
    greedy: torch.Tensor  # [B] bool
    seed: torch.Tensor  # [B] int64
    use_penalties: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    all_greedy: bool
    top_k_cap: int | None = None  # host-side bound on every row's top_k (avoids reading it from the device)

    def take(self, rows: torch.Tensor) -> "SamplingTensors":
        """The settings of the given rows (a row may repeat, e.g. once per window position)."""
        fields = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return SamplingTensors(**fields)


def apply_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor, st: SamplingTensors
) -> torch.Tensor:
    """logits, output_counts [B, V] (float), prompt_mask [B, V] bool -> penalised logits."""
    seen = prompt_mask | (output_counts > 0)
    rep = st.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - st.frequency[:, None] * output_counts - st.presence[:, None] * (output_counts > 0)


# Below this vocabulary a sort is cheaper than 31 full-row passes (on the 2-core CPU at 8192 tokens, batch
# 1: 0.62 vs 1.27 ms; at 151936: 14.9 vs 7.0 ms, benchmarks/RESULTS.md). Both give the same threshold.
BISECT_MIN_VOCAB = 32768
# On CUDA the sort wins at every size measured: inside CUDA graphs on an H100 at 151936 tokens, 0.13 vs 0.59 ms
# at batch 1 and 5.2 vs 10.6 ms at 256 (benchmarks/RESULTS.md): cub's radix sort reads the row a few times,
# the bisection 31 times. Only a one-kernel selection could beat it there. (Tests set this to run both ways.)
BISECT_ON_CUDA = False


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [B, V] float32 >= 0, top_p [B] -> t [B, 1]: top-p keeps the tokens with probability >= t.

    t is the largest probability in the row whose tokens at or above it hold mass >= top_p: the sorted
    prefix that reaches top_p, plus every token tied with the one crossing the line (as FlashInfer's and
    vLLM's threshold versions keep them). A row whose total falls short of top_p (rounding), or whose
    top_p is outside (0, 1) (the filter off), keeps everything.
    """
    on = (top_p > 0.0) & (top_p < 1.0)
    need = torch.where(on, top_p.float(), float("inf"))[:, None]  # [B, 1]; inf: never reached
    if probs.shape[-1] < BISECT_MIN_VOCAB or (probs.is_cuda and not BISECT_ON_CUDA):
        return _threshold_by_sort(probs, need)
    return _threshold_by_bisection(probs, need)


def _threshold_by_sort(probs: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """The crossing token's probability: the last sorted entry whose predecessors hold less than `need`."""
    ranked = probs.sort(dim=-1, descending=True).values  # [B, V]
    last = (ranked.cumsum(-1) - ranked < need).sum(-1, keepdim=True) - 1  # [B, 1]; >= 0 since need > 0
    return ranked.gather(1, last)


def _threshold_by_bisection(probs: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Why bisection over the bits: the int32 pattern of a non-negative float32 orders as its value, so 31
    rounds of (compare + masked row sum) decide t's bits from the top, exactly, with fixed shapes and no
    host read (CUDA-graph safe), and no sort. A byte-wise radix select would take 4 passes, but each
    builds per-row 256-bin mass histograms (scatter_add: atomics-heavy on a GPU) and more code.
    """
    bits = probs.view(torch.int32)  # [B, V]
    t = torch.zeros_like(bits[:, :1])  # [B, 1] bits; stays 0 where no candidate reaches `need`
    for bit in range(30, -1, -1):  # bit 31 is the sign, 0 here
        cand = t | (1 << bit)
        mass = torch.where(bits >= cand, probs, 0.0).sum(-1, keepdim=True)  # [B, 1]
        t = torch.where(mass >= need, cand, t)
    return t.view(torch.float32)


def to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Penalised logits [B, V] -> the request's sampling distribution [B, V] (temperature, top-k, top-p, min-p).
    Logits [B, W, V] (a window of rows per request, st per request) give [B, W, V]."""
    if logits.dim() == 3:
        if not (st.use_top_k or st.use_top_p or st.use_min_p):  # temperature alone broadcasts over the window
            return (logits / st.temperature[:, None, None]).softmax(dim=-1)
        rows = torch.arange(logits.shape[0], device=logits.device).repeat_interleave(logits.shape[1])
        return to_probs(logits.flatten(0, 1), st.take(rows)).view_as(logits)
    logits = logits / st.temperature[:, None]
    if st.use_top_k:
        cap = min(st.top_k_cap if st.top_k_cap is not None else int(st.top_k.max()), logits.shape[-1])
        kth = logits.topk(cap, dim=-1).values.gather(1, (st.top_k.clamp(max=cap) - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((st.top_k > cap)[:, None], float("-inf"))  # rows with top-k off keep everything
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if not (st.use_top_p or st.use_min_p):  # nothing removed after the softmax: it sums to 1 already
        return probs
    if st.use_top_p:
        probs32 = probs.float()  # the search needs float32 bits; the cast is exact, and free when already float32
        probs = probs.masked_fill(probs32 < _top_p_threshold(probs32, st.top_p), 0.0)
    if st.use_min_p:
        probs = probs.masked_fill(probs < st.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (unnormalised is fine), u [B] -> token ids [B]."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def top_m(probs: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate to the top m entries and renormalise: -> (ids [B, m], probs [B, m])."""
    values, ids = probs.topk(min(m, probs.shape[-1]), dim=-1)
    return ids, values / values.sum(-1, keepdim=True)


def sample_draft(logits: torch.Tensor, st: SamplingTensors, m: int, index: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft from (penalised) logits [B, V] at token index [B]: the request's distribution truncated to its top
    m tokens and renormalised (the proposal q') -> (token [B], q' ids [B, m'], q' probs [B, m']), m' = min(m, V).
    Greedy rows draft their top token. With temperature as the only filter, q' is the softmax of the top m
    logits (the vocabulary's normaliser cancels): a topk and one kernel on CUDA (kernels/draft_sample_ref.py)."""
    if st.use_top_k or st.use_top_p or st.use_min_p:
        ids, probs = top_m(to_probs(logits, st), m)
        sampled = ids.gather(1, sample(probs, uniforms(st.seed, index, STREAM_DRAFT))[:, None]).squeeze(1)
        return torch.where(st.greedy, argmax_rows(logits), sampled), ids, probs
    values, ids = logits.topk(min(m, logits.shape[-1]), dim=-1)
    draw = draft_sample_ref
    if use_fused(values):
        from mtpserve.kernels.draft_sample import draft_sample as draw
    token, probs = draw(values, ids, st.temperature, st.greedy, st.seed, index, STREAM_DRAFT)
    return token, ids, probs


def logprobs_topn(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model log-probabilities: -> (chosen [B], top ids [B, n], top values [B, n])."""
    logp = logits.float().log_softmax(-1)
    top = logp.topk(n, dim=-1) if n > 0 else (logp[:, :0], logp[:, :0].long())
    return logp.gather(1, chosen[:, None]).squeeze(1), top[1], top[0]


def top_k_cap(top_ks: list[int], vocab: int) -> int:
    """A power of two >= every active top_k (0 when none is set): few distinct values, so few graphs."""
    active = [k for k in top_ks if 0 < k < vocab]
    return min(1 << (max(active) - 1).bit_length(), vocab) if active else 0
