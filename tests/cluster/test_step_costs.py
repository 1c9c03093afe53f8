"""StepCosts (mtpserve/cluster/step_costs.py): what a decode step costs per (batch bucket, k), the host's share
and the device's, measured where known and modelled elsewhere (the host's price of a draft and the lines' fits:
test_host_prices.py; the chooser's own tests: test_spec_chooser.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mtpserve.cluster.device_costs import DeviceCosts
from mtpserve.cluster.spec_rate import choose_k
from mtpserve.cluster.step_costs import StepCosts

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
