"""StepCosts (mtpserve/cluster/step_costs.py): what a decode step costs per (batch bucket, k), the host's share
and the device's, measured where known and modelled elsewhere; the chooser's own tests are in
test_spec_chooser.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mtpserve.cluster.device_costs import DeviceCosts, _line_fit
from mtpserve.cluster.spec_rate import choose_k
from mtpserve.cluster.host_fits import host_slope, host_slopes, means_of_max
from mtpserve.cluster.step_costs import StepCosts
from mtpserve.cluster.paired_probe import SIDE, PairedProbe

K = 4


def test_step_costs_measured_where_known_and_modelled_elsewhere() -> None:
    costs = StepCosts(K, 64, per_draft_cost=0.1)
    np.testing.assert_allclose(costs.costs(5), [1.0, 1.1, 1.2, 1.3, 1.4])  # nothing measured: the prior
    costs.observe(5, 0, 0.010)  # bucket of 5 (8): k = 0 measured, the rest from the prior slope
    np.testing.assert_allclose(costs.costs(5), [0.010, 0.011, 0.012, 0.013, 0.014])
    costs.observe(5, 2, 0.016)  # slope fitted: 0.3 per draft
    np.testing.assert_allclose(costs.costs(7), [0.010, 0.013, 0.016, 0.019, 0.022])
    costs.observe(64, 0, 0.050)  # another bucket learns the fitted slope too
    np.testing.assert_allclose(costs.costs(64), [0.050, 0.065, 0.080, 0.095, 0.110])
    costs.observe(5, 2, 0.026)
    costs.observe(5, 2, 0.020)  # the median of the recent samples, not the last one
    assert costs.costs(5)[2] == 0.020


def test_a_start_up_seed_is_replaced_by_real_steps() -> None:
    costs = StepCosts(K, 64)
    costs.seed(3, 1, 1.0)
    assert costs.costs(3)[1] == 1.0
    costs.observe(3, 1, 3.0)  # the first real step replaces the seed ...
    assert costs.costs(3)[1] == 3.0
    costs.seed(3, 1, 1.0)  # ... a measured cell ignores later seeds ...
    costs.observe(3, 1, 2.0)
    costs.observe(3, 1, 2.5)  # ... and later steps count with it
    assert costs.costs(3)[1] == 2.5



def test_overlapped_steps_cost_the_slower_of_host_and_device_serial_ones_both() -> None:
    device = [0.20, 0.30, 0.40, 0.50, 0.60]
    overlapped, serial = StepCosts(K, 8), StepCosts(K, 8)
    for k, d in enumerate(device):
        overlapped.observe(1, k, d, host=0.35, overlapped=True)
        serial.observe(1, k, d, host=0.35)
    np.testing.assert_allclose(overlapped.costs(1), [0.35, 0.35, 0.40, 0.50, 0.60])
    np.testing.assert_allclose(serial.costs(1), np.add(device, 0.35))


def test_a_device_bound_laps_gap_past_the_device_share_is_priced_in() -> None:
    """Overlapped steps on the H100 at T = 1, c = 8 (session G, run 45): device 0.37 / 0.64 / 0.81 / 1.25 ms
    at k = 0 / 1 / 2 / 4, laps 0.50 / 0.84 / 0.95 / 1.51 ms, host about 0.45 ms. Laps where the host waited
    teach the gap; a host-bound lap (the host hardly waited) does not. With it the priced steps come
    within 10 % of the laps; max(host, device) alone read them 10-24 % short."""
    costs = StepCosts(K, 64)
    device, laps = [0.37e-3, 0.64e-3, 0.81e-3, 1.25e-3], np.array([0.50e-3, 0.84e-3, 0.95e-3, 1.51e-3])
    for _ in range(4):
        for k, d, lap in zip((0, 1, 2, 4), device, laps):
            costs.observe(8, k, d, host=0.45e-3, overlapped=True, lap=lap)
        costs.observe(64, 0, 0.2e-3, host=2e-3, overlapped=True, lap=2.01e-3)  # host-bound: no gap sample
    assert sum(costs.gap_samples) == 16 and abs(costs.gap(8) - 0.17e-3) < 1e-9  # median of 0.13 / 0.14 / 0.20 / 0.26 ms
    priced = costs.costs(8)[[0, 1, 2, 4]]
    bare = np.maximum(costs.host(8), costs.device(8)[[0, 1, 2, 4]])
    assert (np.abs(priced / laps - 1) < 0.10).all() and (np.abs(bare / laps - 1) > 0.10).all()


def test_a_k_whose_laps_are_host_bound_is_not_priced_with_the_device_bound_gap() -> None:
    """T = 1, c = 8 on the H100 (run 178): k = 3's laps were device-bound, 0.165 ms past its device share;
    k = 2's were host-bound (0.59 ms, host 0.58, device 0.48). The bucket's gap added to k = 2 priced it at
    0.65 ms, and k = 3, 11 % slower in fixed-k cells, looked as good per token."""
    costs = StepCosts(K, 64)
    for _ in range(8):
        costs.observe(8, 3, 0.575e-3, host=0.50e-3, overlapped=True, lap=0.74e-3)
        costs.observe(8, 2, 0.480e-3, host=0.58e-3, overlapped=True, lap=0.59e-3)
    priced = costs.costs(8)
    assert abs(costs.gap(8) - 0.165e-3) < 1e-9
    assert priced[3] == pytest.approx(0.74e-3) and priced[2] < 0.6e-3
    assert costs.gaps(8)[1] == costs.gap(8)  # a k without laps of its own takes the bucket's gap


def test_the_device_share_is_learned_from_laps_the_device_ran_through() -> None:
    """T = 1, c = 1 on the H200 (runs 255 and 264): k = 2's device share read 0.372 ms in device-bound laps and up to
    0.412 in laps where the host was the slower and the device idled for each launch. Kept from those, the cell
    priced k = 2 above what its steps took once the host was fast again, and auto ran k = 3 instead."""
    costs = StepCosts(K, 8)
    for _ in range(16):  # a fast host: the device is the slower
        costs.observe(1, 2, 0.372e-3, host=0.24e-3, overlapped=True, tokens=2.1, lap=0.381e-3)
    for _ in range(16):  # a slow host: the device idles between steps and its share reads high
        costs.observe(1, 2, 0.412e-3, host=0.50e-3, overlapped=True, tokens=2.1, lap=0.51e-3)
    assert costs.device(1)[2] == pytest.approx(0.372e-3)
    for _ in range(16):  # close to each other, the device ran the lap through: its share counts
        costs.observe(1, 1, 0.300e-3, host=0.30e-3, overlapped=True, tokens=1.6, lap=0.31e-3)
    assert costs.device(1)[1] == pytest.approx(0.300e-3)
    assert not costs.timed(1, 3)
    costs.observe(1, 3, 0.46e-3, host=0.60e-3, overlapped=True, tokens=2.3, lap=0.61e-3)  # host-bound only
    assert costs.timed(1, 3) and not costs.timed(1, 3, greedy=False)  # measured: _explore need not time it again


def test_the_gap_is_kept_per_batch_bucket() -> None:
    """A drained closed loop's small batches wait on the device by milliseconds that a full batch's laps do
    not (one median for every bucket read 3.7 ms at c = 8 on the H100 and priced every k there at 4 ms):
    each bucket prices its own gap, and one without device-bound laps borrows the nearest bucket's."""
    costs = StepCosts(K, 64)
    for _ in range(8):
        costs.observe(1, 2, 0.3e-3, host=0.1e-3, overlapped=True, lap=4.0e-3)  # drained: a long wait
        costs.observe(8, 2, 0.5e-3, host=0.3e-3, overlapped=True, lap=0.6e-3)
    assert abs(costs.gap(1) - 3.7e-3) < 1e-9 and abs(costs.gap(8) - 0.1e-3) < 1e-9
    assert abs(costs.gap(16) - 0.1e-3) < 1e-9  # no laps of its own: bucket 8's
    assert costs.costs(8)[2] < 1e-3


def test_every_k_is_priced_with_the_host_as_it_is_now() -> None:
    """The host's share of a step moves with the host (on the H100 one op's time moved 2x inside a run),
    the device's does not: k = 0 timed while the host was fast and k = 4 while it was slow must not make
    k = 4 look dearer than it is. Medians of whole laps read 4.4x here, as the table auto learned in the
    H100's matrix did (k = 4 at 4.4x k = 0 where the steps were about 1.4x)."""
    costs = StepCosts(K, 8)
    for _ in range(16):
        costs.observe(1, 0, 0.20, host=0.25, overlapped=True)  # laps of 0.25
    for _ in range(16):
        costs.observe(1, 4, 0.50, host=1.10, overlapped=True)  # laps of 1.1: the host slowed down
    np.testing.assert_allclose(costs.costs(1), [1.10] * (K + 1))  # host-bound at every k now: drafts are free
    for _ in range(16):
        costs.observe(1, 4, 0.50, host=0.25, overlapped=True)  # the host is fast again
    np.testing.assert_allclose(costs.costs(1)[[0, 4]], [0.25, 0.50])


def test_the_hosts_speed_is_read_from_steps_of_the_batch_priced() -> None:
    """A step's host has a part per step besides the part per request (at T = 1, c = 8 on the H200 about 0.22 ms +
    0.033 ms a request), which the line, drawn per request, spreads over the batch: per request a drain's steps of
    5 read 1.27x full ones of 8. The next full batch is priced at the full steps' host, not at the drain's."""
    costs = StepCosts(K, 8)

    def host(batch: int) -> float:
        return 0.22e-3 + 0.033e-3 * batch

    for _ in range(48):
        costs.observe(8, 2, 1e-4, host=host(8), overlapped=True, tokens=16)
    for batch in (7, 6, 5) * 4:  # the drain: a window's newest 16 hold 4 full steps
        costs.observe(batch, 2, 1e-4, host=host(batch), overlapped=True, tokens=2 * batch)
    np.testing.assert_allclose(costs.costs(8, np.array([8.0, 12, 16, 18, 20])), [host(8)] * (K + 1))
    for _ in range(StepCosts.HOST_WINDOW):  # a drain long enough to fill the bucket's whole window
        costs.observe(5, 2, 1e-4, host=host(5), overlapped=True, tokens=10)
    np.testing.assert_allclose(costs.costs(8, np.array([8.0, 12, 16, 18, 20])), [host(8)] * (K + 1))


def test_the_hosts_share_grows_with_the_tokens_a_step_emits() -> None:
    """Postprocessing is per token: on the H100 at c = 8 the host's share was 0.73 ms at k = 0 (8 tokens a
    step) and 1.25 ms at k = 4 (about 31). A k is priced with the tokens it would emit; where the tokens
    hardly vary (one k at a large batch) the host's share is flat at its median."""
    costs, rng = StepCosts(K, 8), np.random.default_rng(0)
    for k in (0, 4, 2):
        for _ in range(16):
            tokens = 8 * (1 + rng.integers(0, k + 1))  # what 8 requests emit at k
            costs.observe(8, k, 1e-4, host=0.5e-3 + 0.02e-3 * tokens, overlapped=True, tokens=tokens)
    np.testing.assert_allclose(costs.costs(8, np.array([8.0, 15, 21, 26, 31])),
                               0.5e-3 + 0.02e-3 * np.array([8.0, 15, 21, 26, 31]))
    flat, hosts = StepCosts(K, 256), 2e-3 * rng.uniform(0.9, 1.1, 16)
    for host in hosts:
        flat.observe(256, 3, 1e-4, host=host, overlapped=True, tokens=800 + rng.integers(0, 5))
    row = flat.costs(256, np.array([256.0, 470, 640, 800, 930]))
    assert np.ptp(row) == 0 and row[0] == pytest.approx(hosts.mean())  # a host-bound lap's mean
    # A window of one k alone (auto dwelling on its choice) keeps the slope its bucket drew before.
    for _ in range(2 * StepCosts.HOST_WINDOW):
        costs.observe(8, 2, 1e-4, host=0.5e-3 + 0.02e-3 * 21, overlapped=True, tokens=21)
    assert costs.host_line(8)[1] == pytest.approx(0.02e-3)
    np.testing.assert_allclose(costs.host(8, np.array([8.0, 31])), 0.5e-3 + 0.02e-3 * np.array([8.0, 31]))


def test_a_full_windows_slopes_wait_for_host_refit_samples_and_its_level_follows_at_once() -> None:
    """A fit of the slopes is most of a full choice's host time: once a bucket's window is full they are drawn
    again every HOST_REFIT samples, while the host's speed follows every sample (a host that slowed down shows
    in the next choice's prices, its tokens' share too)."""
    costs, rng = StepCosts(K, 8), np.random.default_rng(0)
    for i in range(StepCosts.HOST_WINDOW):
        tokens = 8 * (1 + rng.integers(0, 3))
        costs.observe(8, 2 * (i % 2), 1e-4, host=0.5e-3 + 0.02e-3 * tokens, overlapped=True, tokens=tokens)
    a, slope, _ = costs.host_line(8)
    assert slope == pytest.approx(0.02e-3 / 8 * 8) and a == pytest.approx(0.5e-3)
    for i in range(costs.window):  # the host slows by 0.3 ms a step, and per token too
        tokens = 8 * (1 + rng.integers(0, 3))
        costs.observe(8, 2 * (i % 2), 1e-4, host=0.8e-3 + 0.04e-3 * tokens, overlapped=True, tokens=tokens)
    fitted = costs._slopes[costs.bucket(8)]
    a2, slope2, _ = costs.host_line(8)
    assert a2 > a + 0.3e-3 and slope2 > 1.5 * slope  # at once: the line scaled by the host's speed
    assert costs._slopes[costs.bucket(8)] == fitted  # not fitted again
    for i in range(StepCosts.HOST_REFIT):
        tokens = 8 * (1 + rng.integers(0, 3))
        costs.observe(8, 2 * (i % 2), 1e-4, host=0.8e-3 + 0.04e-3 * tokens, overlapped=True, tokens=tokens)
    costs.host_line(8)
    assert costs._slopes[costs.bucket(8)][0] > 1.2 * fitted[0]  # fitted again


def test_first_samples_of_seeded_cells_update_their_row_without_a_refit(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU every cell is seeded at start; a draining closed loop measures a new cell in every small
    bucket it passes through. Each such first sample is read into its row, not a refit of the whole table (a
    refit per choice cost up to 5 ms on the H100's host)."""
    costs = StepCosts(K, 64)
    for batch in (1, 2, 4, 8):
        for k in range(K + 1):
            costs.seed(batch, k, 1e-4 * (1 + k))
    costs.costs(8)  # the seeds' refit
    fits = []
    estimate = DeviceCosts._estimate
    monkeypatch.setattr(DeviceCosts, "_estimate", lambda self, b=None: (fits.append(b), estimate(self, b))[1])
    for batch in (8, 4, 2, 1):
        for k in range(K + 1):
            costs.observe(batch, k, 2e-4 * (1 + k))
            assert costs.device(batch)[k] == pytest.approx(2e-4 * (1 + k))  # the measured cell, at once
    assert not fits
    # Where a seed is missing, a first sample reshapes the estimates: the table is fitted again.
    costs.observe(64, 0, 1e-3)
    np.testing.assert_allclose(costs.device(64), 1e-3 * (1 + np.arange(K + 1)), rtol=1e-6)
    assert fits


def test_outlying_laps_move_no_cost_and_a_bad_first_one_is_forgotten_at_once() -> None:
    costs = StepCosts(K, 8)
    costs.observe(1, 4, 1.0)
    costs.observe(1, 4, 10.0)  # a GC pause inside the lap
    costs.observe(1, 4, 0.0)  # and a lap that ended early
    assert costs.costs(1)[4] == 1.0
    costs.observe(1, 2, 10.0)  # a cell whose first lap was stretched (an average clipped to 1.5x of itself
    costs.observe(1, 2, 0.5)  # stayed near 10 for dozens of steps, while the chooser avoided k = 2)
    costs.observe(1, 2, 0.5)
    assert costs.costs(1)[2] == 0.5
    for _ in range(2 * costs.window):  # only the recent window counts: the cost moves with the host
        costs.observe(1, 4, 2.0)
    assert costs.costs(1)[4] == 2.0


def test_a_draining_batch_draws_no_host_slope() -> None:
    """A closed loop drains: one bucket sees batches from 256 down to 129 at one k, and its host's share falls
    with the batch while the tokens do too. A line through the raw (host, tokens) pairs read that as the cost
    of a token from a negative intercept (run 69, c = 256: -1.8 ms + 0.014 ms a token), which priced k = 0
    cheapest per token. Per request the tokens hardly vary: no slope is drawn, the host's share is flat."""
    costs, rng = StepCosts(K, 256), np.random.default_rng(3)
    for batch in np.linspace(256, 129, 48).astype(int):
        tokens = batch * rng.uniform(2.25, 2.35)
        costs.observe(int(batch), 4, 1e-3, host=0.3e-3 + 15e-6 * batch + 2e-6 * tokens, overlapped=True, tokens=tokens)
    a, slope, median = costs.host_line(256)
    assert slope == 0.0 and a == median > 0
    assert costs.host(256, np.array([256.0, 589.0])).tolist() == [median, median]


def test_a_host_that_drifted_between_two_ks_draws_no_slope() -> None:
    """32 steps at k = 4 on a slow host (4 ms at 256 rows, 590 tokens) then 32 at k = 0 on a fast one (1.5 ms,
    256 tokens): the line through them crosses zero above zero tokens (the host's speed, not its tokens,
    moved), and priced k = 0 cheapest per token; auto then stayed there for a whole round (run 74)."""
    costs = StepCosts(K, 256)
    for k, host, tokens in ((4, 4e-3, 590.0), (0, 1.5e-3, 256.0)):
        for _ in range(32):
            costs.observe(256, k, 1e-3, host=host, overlapped=True, tokens=tokens)
    a, slope, _ = costs.host_line(256)
    assert slope == 0.0 and a == pytest.approx(1.5e-3)
    costs.host_slopes[costs.bucket(256)] = 1e-5  # a steep slope kept from before: capped at host / tokens now
    for _ in range(StepCosts.HOST_REFIT):  # (a full window's slopes are fitted again every HOST_REFIT samples)
        costs.observe(256, 0, 1e-3, host=1.5e-3, overlapped=True, tokens=256.0)
    a, slope, _ = costs.host_line(256)
    assert a >= 0.0 and slope == pytest.approx(1.5e-3 / 256)


def test_the_tokens_and_drafts_leave_the_host_a_level() -> None:
    """A window of k = 4 alone whose host per request grew with its tokens as if nothing else cost anything (a
    level of 0) priced a greedy c = 128 step at k = 4 at 5.8x k = 0 on the H100; auto ran k = 0 and then
    caught up all 128 requests (run 143). Priced at k = 0, a step keeps at least HOST_KEPT of the host now."""
    rng, batch = np.random.default_rng(1), 128
    costs = StepCosts(K, batch)
    costs.host_draft_slopes[costs.bucket(batch)] = 1e-5  # a steep price per draft kept from a window of two k
    for _ in range(StepCosts.HOST_WINDOW):
        per_request = rng.uniform(3.5, 4.5)  # greedy: tokens a request emits at k = 4
        costs.observe(batch, 4, 1e-4, host=batch * 5e-6 * per_request, overlapped=True, tokens=batch * per_request)
    tokens = batch * np.array([1.0, 1.9, 2.7, 3.5, 4.1])
    host = costs.host(batch, tokens)
    assert host[4] / host[0] == pytest.approx(1 / StepCosts.HOST_KEPT, rel=0.01)  # medians of the newest samples
    assert choose_k(np.diff(tokens), tokens[0], 0, host, current=4) == 4


def test_a_bucket_without_host_samples_borrows_the_nearest_ones_scaled_by_batch() -> None:
    costs = StepCosts(K, 256)
    for _ in range(16):
        costs.observe(256, 4, 1e-3, host=10e-3, overlapped=True, tokens=900)
    a, slope, median = costs.host_line(64)  # bucket 64 never ran a timed step
    assert slope == 0.0 and a == median == 10e-3 * 64 / 256
    np.testing.assert_allclose(costs.costs(64), np.maximum(2.5e-3, costs.device(64)))


def test_sampled_batches_have_their_own_device_costs() -> None:
    """A sampled step's graph runs the rejection sampler and the sampled drafts (2-3x the greedy graph at
    T = 1 on the H100): its seeds and samples do not move the greedy table, nor the other way round."""
    costs = StepCosts(K, 64)
    for k in range(K + 1):
        costs.seed(8, k, 1e-3 * (1 + 0.1 * k))
        costs.seed(8, k, 1e-3 * (1 + 0.5 * k), greedy=False)
    np.testing.assert_allclose(costs.device(8), 1e-3 * (1 + 0.1 * np.arange(K + 1)))
    np.testing.assert_allclose(costs.device(8, greedy=False), 1e-3 * (1 + 0.5 * np.arange(K + 1)))
    costs.observe(8, 2, 5e-3, greedy=False)
    assert costs.device(8, greedy=False)[2] == 5e-3 and costs.device(8)[2] == 1.2e-3
    assert costs.timed(8, 2, greedy=False) and not costs.timed(16, 2, greedy=False)


def test_a_mode_that_knows_nothing_borrows_the_other_ones_device_costs() -> None:
    costs = StepCosts(K, 64)
    for k in range(K + 1):
        costs.observe(8, k, 1e-3 * (1 + k))  # greedy steps only (a CPU engine: no seeds)
    np.testing.assert_allclose(costs.device(8, greedy=False), costs.device(8))  # not a unitless prior
    costs.observe(8, 0, 4e-3, greedy=False)
    assert costs.device(8, greedy=False)[0] == 4e-3


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
    assert price[4] - price[3] == pytest.approx(10e-6, rel=0.02)


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
    step = 0

    def run(k: int, n: int, speed: float = 1.0) -> None:
        nonlocal step
        for _ in range(n):
            tokens = 8 * (1 + 0.5 * k) + 4 * (step % 3)
            costs.observe(8, k, 1e-4, host=speed * 1e-6 * 8 * (20 + 2 * tokens / 8 + 6 * k), tokens=tokens)
            step += 1

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
