"""StepCosts (mtpserve/cluster/step_costs.py), the host's price of a draft: drawn from windows of two k's and from
the chooser's probes (below the modules and past them, where the chain reruns the last one); the host and device
lines as least-squares fits; a lap priced as the mean of the longer of host and device over the host's recent speeds
(the rest of StepCosts: test_step_costs.py)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from mtpserve.cluster.device_costs import _line_fit
from mtpserve.cluster.spec_rate import choose_k
from mtpserve.cluster.host_fits import host_slope, host_slopes, means_of_max
from mtpserve.cluster.step_costs import StepCosts
from mtpserve.cluster.paired_probe import SIDE, PairedProbe

K = 4


def test_the_hosts_share_per_draft_is_priced_beyond_its_tokens() -> None:
    """At T = 1 on the H100 a host-bound step grew about 5 us a request and draft beyond what its tokens
    cost (scheduling, block tables and offers per KV group; c = 128 and 256, run 124). Drawn from a window
    that holds two k, that price stays while the window holds one k again, and it moves the choice: priced
    by tokens alone the most drafts win; priced with it, fewer."""
    rng, batch = np.random.default_rng(4), 256
    costs = StepCosts(K, batch)
    a, b, c = 10e-6, 2e-6, 5e-6  # per request, per token, per request and draft

    def step(k: int) -> None:
        tokens = batch * (1.0 + k * rng.uniform(0.3, 0.5))  # acceptance varies from step to step
        costs.observe(batch, k, 1e-4, host=batch * (a + c * k) + b * tokens, overlapped=True, tokens=tokens)

    for k in [4] * 40 + [2] * 40:
        step(k)
    assert costs.host_per_draft(batch) == pytest.approx(c, rel=1e-6)
    for _ in range(2 * StepCosts.HOST_WINDOW):  # auto dwelling at k = 2
        step(2)
    tokens = batch * np.array([1.0, 1.6, 1.96, 2.18, 2.3])  # acceptance 0.6 a position
    want = batch * (a + c * np.arange(K + 1)) + b * tokens
    np.testing.assert_allclose(costs.costs(batch, tokens), want, rtol=1e-6)
    gains = np.diff(tokens)
    assert choose_k(gains, tokens[0], 0, costs.costs(batch, tokens), current=K) == 1
    assert choose_k(gains, tokens[0], 0, b * tokens + batch * a, current=K) == K  # tokens alone: the most drafts


def test_the_lines_are_least_squares_fits() -> None:
    """The host's and the device's lines, fitted in plain Python, against numpy's least squares."""
    rng = np.random.default_rng(0)
    tokens, ks = rng.uniform(1.0, 5.0, 64), rng.integers(1, 5, 64)
    seconds = 1e-4 + 2e-6 * tokens + 5e-6 * ks + rng.uniform(0.0, 2e-6, 64)
    assert host_slope(seconds.tolist(), tokens.tolist(), float(np.median(seconds))) == pytest.approx(
        np.polyfit(tokens, seconds, 1)[0], rel=1e-9)
    # Two or more k: the tokens' slope within each k (a regression with a level per k), then k's on the rest.
    levels = (ks[:, None] == np.unique(ks)[None, :]).astype(float)
    within = np.linalg.lstsq(np.column_stack((tokens, levels)), seconds, rcond=None)[0][0]
    per_draft = np.polyfit(ks, seconds - within * tokens, 1)[0]
    b, c = host_slopes(seconds.tolist(), tokens.tolist(), ks.tolist(), float(np.median(seconds)), 0.0)
    assert (b, c) == (pytest.approx(within, rel=1e-9), pytest.approx(per_draft, rel=1e-9))
    assert abs(b - 2e-6) < 2e-7 and abs(c - 5e-6) < 5e-7
    row = [1.0, math.nan, 1.3, 1.35, math.nan]
    a, slope, n = _line_fit(row)
    fitted = np.polyfit([0, 2, 3], [1.0, 1.3, 1.35], 1)
    assert n == 3 and (slope, a) == tuple(pytest.approx(v, rel=1e-12) for v in fitted)


def test_a_window_past_the_modules_prices_only_the_drafts_past_them() -> None:
    """k = 3 and 4 over 3 modules (auto probing down from k = 4): the fourth draft reruns the last module, so
    the host price it draws, 10 us a request here, is a recursion's; below the modules a draft also runs a KV
    group of its own, and that price stays what the bucket drew before (nothing here: 0), not extrapolated
    (extrapolated, it sent auto at T = 1, c = 256 on the H100 from k = 4 to k = 1, run 227)."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)
    for i in range(64 + 32 * StepCosts.RECURSION_DRAWS):
        k = 3 + (i // 8) % 2
        tokens = 8 * (1 + 0.5 * k) + 4 * (i % 3)  # acceptance varies within each k: the tokens' slope is drawn there
        costs.observe(8, k, 1e-4, host=1e-6 * (8 * 20 + 2 * tokens + 8 * 10 * k), tokens=tokens)
        if i >= 63 and i % 32 == 31:  # a choice reads the line (it refits every HOST_REFIT samples)
            costs.host_draft_prices(8)
    price = costs._host_fit(8)[2]
    assert price[4] - price[3] == pytest.approx(10e-6, rel=0.02)
    assert price[:4] == [0.0] * 4 and costs.knows_recursion(8)
    flat = StepCosts(max_k=4, max_rows=8)  # as many modules as k: the same window prices every draft
    for i in range(64):
        k = 3 + (i // 8) % 2
        tokens = 8 * (1 + 0.5 * k) + 4 * (i % 3)
        flat.observe(8, k, 1e-4, host=1e-6 * (8 * 20 + 2 * tokens + 8 * 10 * k), tokens=tokens)
    assert flat.host_per_draft(8) > 5e-6 and not flat.knows_recursion(8)  # (scaled down to keep HOST_KEPT)


def test_a_draft_past_the_modules_is_priced_by_three_probes_not_one_the_host_drifted_in() -> None:
    """k = 4 over 3 modules, a draft costing the host nothing beyond its tokens, and auto probing k = 3 for 8 steps
    once a host window has seen k = 4 alone: in the first probe the host ran 0.6x as long (its speed moves 2x within
    seconds on the H100's host), which read as 27 us a request for the fourth draft. Priced from that probe alone,
    k = 3 looked best (run 235, random prompts at c = 128); the lower median of three probes prices the draft at what
    it costs."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)
    step = 0
    for probe in range(StepCosts.RECURSION_DRAWS + 1):
        for i in range(StepCosts.HOST_WINDOW):
            costs.observe(8, 4, 1e-4, host=1e-6 * (8 * 50 + 2 * (8 + 4 * (step % 3))), tokens=8 + 4 * (step % 3))
            step += 1
        for i in range(8):
            speed = 0.6 if probe == 1 else 1.0
            tokens = 8 + 3 * (step % 3)
            costs.observe(8, 3, 1e-4, host=1e-6 * speed * (8 * 50 + 2 * tokens), tokens=tokens)
            step += 1
        if probe == 1:
            assert not costs.knows_recursion(8) and costs.host_draft_prices(8)[4] == 0.0
        costs.host_draft_prices(8)  # the next choice reads the line: the probe is drawn
    assert costs.knows_recursion(8)
    assert costs.host_draft_prices(8) == [0.0] * 5
    assert max(costs._recursion_draws[costs.bucket(8)]) > 20e-6  # the drifted probe's draw, outvoted


def _steps_at(costs: StepCosts, level_us: float, draft_us: float) -> Callable[..., None]:
    """run(k, n, speed=1.0): n host samples of 8 requests at k, each (level_us + 2 a token + draft_us a draft) us a
    request at the host's speed, the tokens a request emits varying within each k as acceptance does."""
    steps = itertools.count()

    def run(k: int, n: int, speed: float = 1.0) -> None:
        for step in itertools.islice(steps, n):
            tokens = 8 * (1 + 0.5 * k) + 4 * (step % 3)
            costs.observe(8, k, 1e-4, host=speed * 1e-6 * 8 * (level_us + 2 * tokens / 8 + draft_us * k), tokens=tokens)

    return run


def test_probes_past_the_modules_draw_the_recursions_price_a_b_a_and_outweigh_a_drifting_window() -> None:
    """k = 4 over 3 modules, the fourth draft costing the host nothing beyond its tokens (2 us each). Windows whose
    k = 3 steps ran on a 1.3x faster host than their k = 4 steps read the drift as the price (up to 4.9 us a request
    at T = 1, c = 256 on the H200, run 326); a majority of paired probes of k = 3 (A/B/A) outvote those draws, and
    windows draw it no more."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)
    run = _steps_at(costs, level_us=40.0, draft_us=0.0)

    def drifted_windows() -> None:
        for _ in range(StepCosts.RECURSION_DRAWS):
            run(3, 32, speed=0.77)
            run(4, 32)
            costs.host_draft_prices(8)  # a choice reads (and fits) the line

    def recursion() -> float:
        price = costs.host_draft_prices(8)
        return price[4] - price[3]

    drifted_windows()
    assert costs.knows_recursion(8) and recursion() > 5e-6  # the drift, read as the fourth draft's price
    for _ in range(StepCosts.RECURSION_DRAWS // 2 + 1):
        costs.begin_probe(8, 4)
        run(3, 8)
        run(4, 40)
        costs.host_draft_prices(8)
    assert recursion() < 0.5e-6
    drifted_windows()
    assert recursion() < 0.5e-6


def test_a_window_on_both_sides_of_the_modules_draws_the_group_price_beside_the_recursion_s() -> None:
    """Host per request 60 us + 2 us a token + 5 us a draft below the 3 modules + 10 us a draft past them: k = 3
    and 4 draw the recursion's 10 us; then k = 2, 3 and 4 draw the 5 us of a draft below the modules, the
    recursion's price taken out first (a review found the fit on raw k mixing the two)."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)

    def sample(i: int, k: int) -> None:
        tokens = 8 * (1 + 0.5 * k) + 4 * (i % 3)
        costs.observe(8, k, 1e-4, host=1e-6 * 8 * (60 + 2 * tokens / 8 + 5 * min(k, 3) + 10 * max(k - 3, 0)),
                      tokens=tokens)

    for i in range(64 + 32 * StepCosts.RECURSION_DRAWS):
        sample(i, 3 + (i // 8) % 2)
        if i >= 63 and i % 32 == 31:  # a choice reads the line: it refits
            costs.host_draft_prices(8)
    assert costs.host_draft_prices(8)[4] == pytest.approx(10e-6, rel=0.02)
    for i in range(64):
        sample(i, 2 + (i // 8) % 3)
    price = costs.host_draft_prices(8)
    assert price[1] == pytest.approx(5e-6, rel=0.02) and price[3] == pytest.approx(15e-6, rel=0.02)
    assert price[4] - price[3] == pytest.approx(5e-6, rel=0.02)  # bounded by the draft below the modules, drawn now
    costs.bound_recursion = False  # the recursion's own price, as drawn
    assert costs._draft_prices(costs.bucket(8))[1] == pytest.approx(10e-6, rel=0.02)


def test_a_lap_is_priced_at_its_mean_where_host_and_device_are_close() -> None:
    """A lap lasts the longer of host and device, so where the two are close every slow host lap is a slow step:
    at T = 1, c = 1 on the H100, k = 0's laps (host 0.189 ms, device 0.190) had a mean 8 % over their median, and
    priced at the medians k = 0 looked as good as k = 2, which ran 12 % faster. A k whose device has slack over
    the host's spread is still priced at its device."""
    costs, hosts = StepCosts(K, 8), [0.185e-3] * 12 + [0.26e-3] * 4
    for host in hosts:
        costs.observe(1, 0, 0.19e-3, host=host, overlapped=True, tokens=1.0, lap=max(host, 0.195e-3))
    costs.seed(1, 1, 0.324e-3)
    costs.seed(1, 2, 0.378e-3)
    row = costs.costs(1, np.array([1.0, 1.5, 1.9, 2.1, 2.2]))
    assert row[0] == pytest.approx(sum(max(h, 0.19e-3) for h in hosts) / len(hosts))  # 0.2075 ms, not 0.19
    assert row[2] == pytest.approx(0.378e-3)
    # k = 2 at 1.9 tokens a step beats k = 0 (4.8 against 5.0 tokens a ms); priced at the medians it lost (5.3).
    assert choose_k([0.5, 0.4, 0.2, 0.1], 1.0, 0, row, current=0, hysteresis=0.02) == 2


def test_a_slower_host_scales_every_part_of_the_line() -> None:
    """A slower host is slower at every part of a step (run 77 on the H100: every host phase alike), so its speed
    scales the line's level, tokens and drafts together. Added to the level alone, a slowdown while dwelling at
    k = 4 charged every lower k the slowed part of k = 4's tokens and drafts."""
    costs, rng = StepCosts(K, 8), np.random.default_rng(1)

    def host(k: int, tokens: float, speed: float) -> float:  # per step of 8 requests: 0.15 ms + 20 us a token
        return speed * (0.15e-3 + 20e-6 * tokens + 8 * 2e-6 * k)

    for i in range(StepCosts.HOST_WINDOW):  # two k's at speed 1: the line is drawn
        k = 2 * (1 + i % 2)
        tokens = 8 + rng.integers(0, 8 * k + 1)
        costs.observe(8, k, 1e-4, host=host(k, tokens, 1.0), overlapped=True, tokens=tokens)
    for _ in range(costs.window):  # then the host slows 2x while auto dwells at k = 4
        tokens = 8 + rng.integers(16, 33)
        costs.observe(8, 4, 1e-4, host=host(4, tokens, 2.0), overlapped=True, tokens=tokens)
    emitted = np.array([8.0, 13, 17, 19, 20])
    np.testing.assert_allclose(costs.host(8, emitted), [host(k, t, 2.0) for k, t in enumerate(emitted)], rtol=0.02)


def test_the_overlapped_row_is_the_mean_of_the_longer_share_over_the_hosts_speeds() -> None:
    """means_of_max (a bisection over the speeds in order) against the plain mean of max(host * q, floor)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        spread = rng.uniform(0.5, 2.0, size=int(rng.integers(1, 17))).tolist()
        host, floors = rng.uniform(0.0, 2.0, size=K + 1).tolist(), rng.uniform(0.0, 2.0, size=K + 1).tolist()
        host[0] = 0.0  # a host share clamped at zero: the floor alone
        want = [sum(max(h * q, f) for q in spread) / len(spread) for h, f in zip(host, floors)]
        assert means_of_max(host, floors, spread) == pytest.approx(want, rel=1e-12)


def _overlapped(costs: StepCosts, batch: int, k: int, host: float, device: float, n: int) -> None:
    for _ in range(n):
        costs.observe(batch, k, device, host=host, overlapped=True, tokens=batch * (1.0 + k), lap=max(host, device))


def test_a_draft_price_is_moot_where_the_host_waits_for_the_device_at_k_and_k_minus_1() -> None:
    costs = StepCosts(K, 8)
    for k in range(K + 1):
        costs.seed(1, k, 1e-6 * (290 + 10 * k))
    _overlapped(costs, 1, 4, host=250e-6, device=330e-6, n=StepCosts.K_LAPS - 1)
    assert not costs.draft_price_moot(1, 4)  # too few laps to tell
    _overlapped(costs, 1, 4, host=250e-6, device=330e-6, n=1)
    assert costs.draft_price_moot(1, 4)  # device-bound, and 0.25 ms of host under k = 3's 0.32 ms of device
    _overlapped(costs, 1, 4, host=318e-6, device=330e-6, n=1)  # one lap where the host hardly waited
    assert not costs.draft_price_moot(1, 4)
    fast = StepCosts(K, 8)
    for k in range(K + 1):
        fast.seed(1, k, 1e-6 * (60 + 60 * k))  # k = 3's device share 0.24 ms: its step would wait for the host
    _overlapped(fast, 1, 4, host=250e-6, device=300e-6, n=StepCosts.K_LAPS)
    assert not fast.draft_price_moot(1, 4)


def test_a_probe_below_the_modules_draws_a_drafts_price_from_its_neighbours_not_from_a_drifting_window() -> None:
    """Host per request (20 + 2 a token + 6 a draft) us at the host's speed. A probe of k = 2 between steps at
    k = 3 draws the 6 us A/B/A (paired_probe.py); a later window whose k = 2 steps ran on a 1.3x slower host
    than its k = 3 steps (auto's choices follow such changes) would draw 0, and is not taken over the probe's."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)
    run = _steps_at(costs, level_us=20.0, draft_us=6.0)

    run(3, 64)
    costs.host_draft_prices(8)  # a choice reads (and fits) the line
    for probe in range(StepCosts.DRAFT_DRAWS):
        assert not costs.knows_draft_price(8)
        costs.begin_probe(8, 3)
        run(2, 8)
        run(3, 40)
    assert costs.knows_draft_price(8)
    assert costs.host_draft_prices(8)[1] == pytest.approx(6e-6, rel=0.05)
    run(2, 32, speed=1.3)
    run(3, 32)
    assert costs.host_draft_prices(8)[1] == pytest.approx(6e-6, rel=0.05)


def test_a_probe_is_void_where_another_k_runs_and_draws_nothing_from_too_few_steps() -> None:
    probe = PairedProbe(3, [(50e-6, 2.0)] * 8)
    assert probe.add(3, 50e-6, 2.0) is None  # a step at k still in flight when the probe began: not its own
    assert probe.add(2, 44e-6, 1.8) is None and probe.add(4, 60e-6, 2.2) is False
    short = PairedProbe(3, [(50e-6, 2.0)] * 8)
    for _ in range(3):
        short.add(2, 44e-6, 1.8)
    for _ in range(SIDE - 1):
        assert short.add(3, 50e-6, 2.0) is None
    assert short.add(3, 50e-6, 2.0) is True and short.draw(0.0) is None  # 3 steps of the probe's own: too few
    full = PairedProbe(3, [(50e-6, 2.0)] * 8)
    for _ in range(8):
        full.add(2, 44e-6, 1.8)
    for _ in range(SIDE):
        full.add(3, 50e-6, 2.0)
    assert full.draw(10e-6) == pytest.approx(6e-6 - 10e-6 * 0.2)  # the 0.2 tokens a request more at k priced out


def test_a_bounded_price_past_the_modules_is_at_most_the_one_below_them() -> None:
    """AdaptiveConfig.bound_recursion: a draft past the modules has no KV group of its own, so its price (drawn 4 us
    here) is held to the price of a draft below them (2 us) once a window or probes drew that above 0 (0 is what a
    bucket holds before any draw, and what a floored draw reads: bounded by it, drafts past the modules were free)."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)
    b = costs.bucket(8)
    costs.host_recursion_slopes[b] = 4e-6  # settled by probes past the modules
    assert costs.bound_recursion  # on by default
    assert costs._draft_prices(b) == (0.0, 4e-6)  # nothing drawn below the modules yet: 0 bounds nothing
    costs.host_draft_slopes[b] = 2e-6  # a window's draw: no probe below the modules has drawn it yet
    costs.bound_recursion = False
    assert costs._draft_prices(b) == (2e-6, 4e-6)
    costs.bound_recursion = True
    assert costs._draft_prices(b) == (2e-6, 2e-6)
    costs._draft_draws[b].extend([3e-6] * StepCosts.DRAFT_DRAWS)
    costs.host_draft_slopes[b] = 3e-6  # the probes' median
    assert costs._draft_prices(b) == (3e-6, 3e-6)
    costs.host_recursion_slopes[b] = 1e-6
    assert costs._draft_prices(b) == (3e-6, 1e-6)  # a bound, not a floor
    costs.host_draft_slopes[b] = 0.0  # a floored draw
    assert costs._draft_prices(b) == (0.0, 1e-6)


def test_a_draft_is_priced_at_most_as_a_token_once_the_token_price_is_drawn() -> None:
    """AdaptiveConfig.cap_drafts: a draft costs the host less than a token does (a token is also detokenized, output
    and hashed into blocks), so the probes' draws (past the modules 12 us a request here, below them 5) stand at most
    at the token's price drawn within steps (3 us), and as drawn until that price is."""
    costs = StepCosts(max_k=4, max_rows=8, modules=3)
    b = costs.bucket(8)
    costs.host_recursion_slopes[b], costs.host_draft_slopes[b] = 12e-6, 5e-6
    costs.bound_recursion = False
    assert costs.cap_drafts and costs.tokens.price is None  # on by default; no token price drawn yet
    assert costs._draft_prices(b) == (5e-6, 12e-6)
    costs.tokens.price = 3e-6
    assert costs._draft_prices(b) == (3e-6, 3e-6)
    costs.host_draft_slopes[b] = 1e-6
    assert costs._draft_prices(b) == (1e-6, 3e-6)  # a cap, not a floor
    costs.bound_recursion = True  # as by default: capped, then bounded by the price below
    assert costs._draft_prices(b) == (1e-6, 1e-6)
    costs.tokens.price = 0.0  # a floored token price caps nothing
    assert costs._draft_prices(b) == (1e-6, 1e-6)
    costs.bound_recursion = False
    assert costs._draft_prices(b) == (1e-6, 12e-6)
    costs.cap_drafts, costs.tokens.price = False, 3e-6
    assert costs._draft_prices(b) == (1e-6, 12e-6)

