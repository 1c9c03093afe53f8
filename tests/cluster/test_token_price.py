"""The host's price of a token drawn within steps (mtpserve/cluster/token_price.py): each request's share of a step's
postprocessing against the tokens it kept, and the host line that takes it as its slope (step_costs.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.host_fits import host_slopes
from mtpserve.cluster.step_costs import StepCosts
from mtpserve.cluster.token_price import OUTLIER, TokenPrice, within_step_slope
from tests.checkpoints import write_tokenizer
from tests.conftest import prompts_of

K = 4


def _step(rng: np.random.Generator, n: int, per_token: float, level: float = 5e-6, block_event: float = 0.0,
          k: int = K) -> tuple[list[int], list[float]]:
    """One timed step of n requests at k drafts: per request the tokens it kept and its seconds, `level` each plus
    `per_token` a token, and `block_event` when its tokens fill a KV block of 16 (a chance of tokens / 16), with
    0.3 us of noise."""
    tokens = rng.integers(1, k + 2, n)
    filled = rng.random(n) < tokens / 16
    seconds = level + per_token * tokens + block_event * filled + rng.normal(0.0, 0.3e-6, n)
    return tokens.tolist(), seconds.tolist()


def test_the_slope_holds_the_blocks_offered_as_often_as_tokens_fill_them() -> None:
    """A block offered costs a request a few microseconds in the steps where its tokens fill one: a share of the
    token's price that a median would drop (most requests at every token count offer nothing)."""
    rng = np.random.default_rng(0)
    steps = [_step(rng, 256, 0.4e-6, block_event=8e-6) for _ in range(150)]
    assert within_step_slope(steps) == pytest.approx(0.4e-6 + 8e-6 / 16, rel=0.05)


def test_steps_at_other_k_and_host_speeds_pool_only_their_spread() -> None:
    """At a small batch a pool spans many steps: some at k = 0, whose requests each keep one token and cost the host
    less, some on a slower host. Pooled as one regression they read as a price of tokens; within steps they do not."""
    rng = np.random.default_rng(1)
    steps = [_step(rng, 8, 0.5e-6, level=level, k=k) for level, k in ((4e-6, 0), (9e-6, 4), (14e-6, 4)) * 60]
    assert within_step_slope(steps) == pytest.approx(0.5e-6, rel=0.15)
    pairs = [(t, x) for tokens, seconds in steps for t, x in zip(tokens, seconds)]
    assert np.polyfit(*zip(*pairs), 1)[0] > 1.5e-6  # one regression over the pool


def test_a_pause_of_the_host_does_not_move_the_slope() -> None:
    rng = np.random.default_rng(2)
    steps = [_step(rng, 64, 0.5e-6) for _ in range(4)]
    clean = within_step_slope(steps)
    tokens, seconds = steps[0]
    seconds[0] = 5e-3  # a GC pause inside one request's share: over OUTLIER times the median
    assert 5e-3 > OUTLIER * float(np.median([x for _, xs in steps for x in xs]))
    assert within_step_slope(steps) == pytest.approx(clean, rel=0.05)
    assert clean == pytest.approx(0.5e-6, rel=0.2)


def test_no_slope_where_no_steps_tokens_vary_and_none_below_zero() -> None:
    assert within_step_slope([([1] * 8, [5e-6] * 8)] * 4) is None  # k = 0: every request kept one token
    assert within_step_slope([([1, 3] * 4, [6e-6, 5e-6] * 4)]) == 0.0


def test_one_step_in_every_is_timed_and_pools_draw_the_median_price() -> None:
    price = TokenPrice()
    assert [price.due() for _ in range(3 * TokenPrice.EVERY)].count(True) == 3
    rng = np.random.default_rng(3)
    price.add([1] * TokenPrice.POOL, [5e-6] * TokenPrice.POOL)  # no spread of tokens: not pooled
    assert price._pool == []
    per_token = [0.5e-6, 0.9e-6, 0.6e-6]
    for drawn, slope in enumerate(per_token):
        price.add(*_step(rng, TokenPrice.POOL // 2, slope))  # half a pool: nothing drawn from it yet
        assert len(price._draws) == drawn
        price.add(*_step(rng, TokenPrice.POOL // 2, slope))
        assert len(price._draws) == drawn + 1 and price._pool == []
    assert price.price == sorted(price._draws)[1] == pytest.approx(0.6e-6, rel=0.2)  # the median draw


def test_a_token_price_drawn_elsewhere_leaves_the_window_the_price_of_a_draft() -> None:
    """Given the token's price, the window's least squares draws the drafts' price on what the tokens leave."""
    rng = np.random.default_rng(3)
    tokens, ks = rng.uniform(1.0, 5.0, 64), rng.integers(1, 5, 64)
    seconds = 1e-4 + 2e-6 * tokens + 5e-6 * ks + rng.uniform(0.0, 2e-6, 64)
    b, c = host_slopes(seconds.tolist(), tokens.tolist(), ks.tolist(), float(np.median(seconds)), 0.0, 2e-6)
    assert b == 2e-6 and c == pytest.approx(np.polyfit(ks, seconds - 2e-6 * tokens, 1)[0], rel=1e-9)
    one_k = [3] * 64
    assert host_slopes(seconds.tolist(), tokens.tolist(), one_k, float(np.median(seconds)), 0.0, 2e-6) == (2e-6, None)


def _drifting_one_k(costs: StepCosts, batch: int, rng: np.random.Generator) -> None:
    """Two windows of steps at k = 3 alone whose host slows as acceptance rises (a, b, c per request: 8 us, 0.5 us a
    token, 1.5 us a draft; the host's speed moves by 30 % as tokens move by 16 %)."""
    for k in range(K + 1):  # the device's share at each k, from start-up timings: the steps are host-bound
        costs.seed(batch, k, 2e-4 * (1.0 + 0.1 * k))
    for i in range(2 * StepCosts.HOST_WINDOW):
        phase = np.sin(i / 9.0)
        tokens = 2.2 * (1.0 + 0.08 * phase + 0.01 * rng.standard_normal())
        host = (8e-6 + 0.5e-6 * tokens + 1.5e-6 * 3) * (1.0 + 0.06 * phase)
        costs.observe(batch, 3, 2e-4, host=host * batch, overlapped=True, tokens=tokens * batch, lap=host * batch)


def test_within_steps_the_hosts_drift_no_longer_prices_tokens() -> None:
    """Run 325 (T = 1, c = 128, H200): windows of k = 3 alone priced a token at 8.6-14 us where the host's drift
    followed the tokens, and k = 0 looked a third of k = 3's cost. With the price drawn within steps, the line's
    slope is that price, and k = 0 is priced as what it is."""
    batch, tokens = 128, 128 * np.array([1.0, 1.6, 1.95, 2.2, 2.35])
    true = 8e-6 + 0.5e-6 * tokens / batch + 1.5e-6 * np.minimum(np.arange(K + 1), 3)  # per request
    window, within = StepCosts(K, batch, modules=3), StepCosts(K, batch, modules=3)
    within.tokens.add_draw(0.5e-6)
    for costs in (window, within):
        costs.cap_drafts = False  # a draft here costs the host 3x a token, which AdaptiveConfig.cap_drafts would cap
        b = costs.bucket(batch)  # the price of a draft below the modules as five probes drew it (test_host_prices.py)
        costs._draft_draws[b].extend([1.5e-6] * costs.DRAFT_DRAWS)
        costs.host_draft_slopes[b] = 1.5e-6
        _drifting_one_k(costs, batch, np.random.default_rng(4))
    assert window.host_line(batch)[1] > 3e-6  # the drift's price: six times the true one
    assert within.host_line(batch)[1] == pytest.approx(0.5e-6, rel=0.3)  # scaled by the host's speed now
    priced = {name: costs.costs(batch, tokens) for name, costs in (("window", window), ("within", within))}
    assert priced["within"][0] / priced["within"][3] == pytest.approx(true[0] / true[3], abs=0.03)
    assert priced["window"][0] / priced["window"][3] < true[0] / true[3] - 0.08


@pytest.fixture(scope="module")
def with_tokenizer(partly_trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """partly_trained with a tokenizer: the output path detokenizes, as a served model's does."""
    path = tmp_path_factory.mktemp("with_tokenizer")
    for f in partly_trained.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    write_tokenizer(path, 64)
    return path


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@pytest.mark.parametrize("within_steps", [True, False])
def test_the_engine_draws_the_price_from_its_own_steps_unless_told_not_to(with_tokenizer: Path,
                                                                          within_steps: bool) -> None:
    """Each token made to cost the output path 40 us more: the price the engine draws from its own steps holds them
    (a request's share paired with another's tokens, or a finishing request's, would not)."""
    llm = LLM(str(with_tokenizer), block_size=4, max_num_seqs=16)
    adaptive, process = llm.engine.adaptive, llm.engine.outputs.process
    adaptive.config = dataclasses.replace(adaptive.config, token_price_within_steps=within_steps)

    def slow_process(req: Any, tokens: list[int], logprobs: Any) -> Any:
        _busy(40e-6 * len(tokens))
        return process(req, tokens, logprobs)

    llm.engine.outputs.process = slow_process  # type: ignore[method-assign]
    outs = llm.generate(prompts_of(64, [5, 9, 13, 3] * 16, seed=5),
                        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, num_speculative_tokens=3))
    assert all(len(o.token_ids) == 64 for o in outs)  # fixed k = 3: tokens vary with acceptance, not the choices
    price = adaptive.costs.tokens.price
    if not within_steps:
        assert price is None and not adaptive.costs.tokens._draws
        return
    assert price is not None and 35e-6 <= price < 70e-6  # the busy time and the output path's own few us (CPU noise)
