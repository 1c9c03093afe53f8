"""The acceptance estimates adaptive speculation chooses with (mtpserve/cluster/acceptance.py, docs/design.md §9):
per request and position, decayed toward what verification observes, folded from a queue of steps as one-by-one
updates would, and the engine-wide prior new requests start from."""

from __future__ import annotations

import numpy as np
import pytest

from mtpserve.cluster.acceptance import AcceptanceTable
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.spec_config import AdaptiveConfig

K = 4


def test_estimates_decay_toward_what_is_observed() -> None:
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=4, decay=0.5, initial_acceptance=0.6, min_dwell=0))
    row = np.array([spec.admit(K, True)])
    t = spec.acceptance
    np.testing.assert_allclose(t.p[:, row[0]], 0.6)
    t.observe(row, np.array([3]), np.array([1]))  # draft 1 accepted, draft 2 rejected, draft 3 not reached
    np.testing.assert_allclose(t.p[:, row[0]], 0.6)  # queued until folded
    t.flush()
    np.testing.assert_allclose(t.p[:, row[0]], [0.8, 0.3, 0.6, 0.6])
    for _ in range(4):  # a change of topic: nothing is accepted any more
        t.observe(row, np.array([3]), np.array([0]))
    t.flush()
    assert t.p[0, row[0]] < 0.06
    spec.choose(row)
    assert spec.k == 0 or spec.choose(row) == 0


def test_new_requests_start_from_the_engine_wide_prior() -> None:
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, prior_decay=0.5, initial_acceptance=0.6))
    rows = np.array([spec.admit(K, True) for _ in range(4)])
    spec.acceptance.observe(rows, np.full(4, 2), np.array([0, 0, 0, 1]))  # position 1: 1 of 4; position 2: 0 of 1
    spec.acceptance.flush()
    # Four observations of position 1 weigh 1 - 0.5^4 (more than the plain mean's 1 / 5), position 2's one 0.5.
    np.testing.assert_allclose(spec.estimates(), [0.5**4 * 0.6 + (1 - 0.5**4) * 0.25, 0.3, 0.6, 0.6])
    spec.release(int(rows[0]))
    fresh = spec.admit(K, True)
    np.testing.assert_allclose(spec.acceptance.p[:, fresh], spec.acceptance.prior)


def _observe_stepwise(t: AcceptanceTable, steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """The rows' update one observation at a time, each moving p by `decay` toward its outcome."""
    d = t.config.decay
    for rows, drafts, accepted in steps:
        seen = np.arange(t.p.shape[0])[:, None] < np.minimum(accepted + 1, drafts)
        hit = (np.arange(t.p.shape[0])[:, None] < accepted).astype(float)
        t.p[:, rows] = np.where(seen, (1 - d) * t.p[:, rows] + d * hit, t.p[:, rows])
        t.n[:, rows] = np.where(seen, (1 - d) * t.n[:, rows] + 1, t.n[:, rows])


def _twin_tables(n: int) -> tuple[AcceptanceTable, AcceptanceTable, list[int]]:
    """Two tables with the same n rows acquired, to be fed alike by two routes."""
    config = AdaptiveConfig(max_k=K, max_rows=8)
    a, b = AcceptanceTable(config), AcceptanceTable(config)
    rows = [a.acquire(K, True) for _ in range(n)]
    assert [b.acquire(K, True) for _ in range(n)] == rows
    return a, b, rows


def test_queued_steps_fold_as_one_by_one_updates_where_a_rows_outcomes_agree() -> None:
    folded, stepwise, rows = _twin_tables(6)
    rng = np.random.default_rng(3)
    drafts = dict(zip(rows, rng.integers(0, K + 1, 6)))  # each row drafts and accepts alike at every step
    accepted = {r: int(rng.integers(0, d + 1)) for r, d in drafts.items()}
    steps = []
    for _ in range(20):
        r = rng.choice(rows, size=int(rng.integers(1, 7)), replace=False)
        steps.append((r, np.array([drafts[i] for i in r]), np.array([accepted[i] for i in r])))
    for i, step in enumerate(steps):
        folded.observe(*step)
        if i == 11:
            folded.flush()  # two folds, of 12 and of 8 steps
    folded.flush()
    _observe_stepwise(stepwise, steps)
    np.testing.assert_allclose(folded.p, stepwise.p, rtol=1e-12)
    np.testing.assert_allclose(folded.n, stepwise.n, rtol=1e-12)


def test_a_block_of_mixed_outcomes_moves_each_estimate_toward_their_mean() -> None:
    t = AcceptanceTable(AdaptiveConfig(max_k=K, max_rows=2, decay=0.5, initial_acceptance=0.6, prior_decay=0.5))
    row = np.array([t.acquire(K, True)])
    outcomes = [1, 0, 1, 0]  # position 1 accepted, rejected, accepted, rejected
    for a in outcomes:
        t.observe(row, np.array([1]), np.array([a]))
    t.flush()
    np.testing.assert_allclose(t.p[:, 0], [0.5**4 * 0.6 + (1 - 0.5**4) * 0.5, 0.6, 0.6, 0.6])
    np.testing.assert_allclose(t.n[:, 0], [(1 - 0.5**4) / 0.5, 0, 0, 0])
    # One by one, the order decides (the last outcome weighs most); the block lies between the two orders.
    orders = []
    for seq in (outcomes, outcomes[::-1]):
        one = AcceptanceTable(t.config)
        one.acquire(K, True)
        _observe_stepwise(one, [(row, np.array([1]), np.array([a])) for a in seq])
        orders.append(one.p[0, 0])
    assert min(orders) < t.p[0, 0] < max(orders)
    # The prior: four observations weigh 1 - 0.5^4 (more than a plain mean's 4 / (4 + 4)).
    np.testing.assert_allclose(t.prior, [0.5**4 * 0.6 + (1 - 0.5**4) * 0.5, 0.6, 0.6, 0.6])


def test_a_step_queued_as_the_scheduler_gathers_it_folds_as_arrays_do() -> None:
    """The scheduler queues each step as (row, drafts, accepted) triples, made an array only at the fold."""
    arrays, triples, rows = _twin_tables(5)
    rng = np.random.default_rng(5)
    for _ in range(12):
        r = rng.choice(rows, size=int(rng.integers(1, 6)), replace=False)
        drafts = rng.integers(1, K + 1, len(r))
        accepted = (rng.random(len(r)) * (drafts + 1)).astype(np.int64)
        arrays.observe(r, drafts, accepted)
        triples.observe_step(list(zip(r.tolist(), drafts.tolist(), accepted.tolist())))
    triples.observe_step([])  # a step where nobody drafted queues nothing
    arrays.flush()
    triples.flush()
    for a, b in ((arrays.p, triples.p), (arrays.n, triples.n), (arrays.prior, triples.prior)):
        np.testing.assert_array_equal(a, b)
    assert arrays.prior_list == triples.prior_list == triples.prior.tolist() and arrays.prior_list != [0.8] * K


def test_the_queue_of_observations_stays_bounded_when_no_choice_folds_it() -> None:
    """Only fixed-k requests running: the chooser makes no choice, so nothing reads the estimates; their
    observations are still folded (they teach the engine-wide prior) and the queue never holds more than
    max_dwell steps."""
    t = AcceptanceTable(AdaptiveConfig(max_k=K, max_rows=4, max_dwell=16))
    rows = [t.acquire(K, False) for _ in range(4)]
    for _ in range(1000):
        t.observe_step([(row, K, K) for row in rows])  # every draft accepted
        assert len(t._pending) < 16
    assert (t.prior > 0.99).all() and (t.p[:, rows] > 0.99).all()


def test_a_reused_row_starts_over_and_its_old_steps_count_for_the_prior_only() -> None:
    t = AcceptanceTable(AdaptiveConfig(max_k=K, max_rows=2, initial_acceptance=0.6, prior_decay=0.5))
    row = t.acquire(K, True)
    t.observe(np.array([row]), np.array([2]), np.array([0]))  # the first holder: position 1 rejected
    t.release(row)
    assert t.acquire(K, True) == row  # reused before the fold: starts from the last fold's prior
    t.observe(np.array([row]), np.array([2]), np.array([2]))  # the second holder: both accepted
    t.flush()
    d = t.config.decay
    np.testing.assert_allclose(t.p[:2, row], 0.6 + d * (1.0 - 0.6))  # its own step only
    assert t.prior[0] < 0.6 + 0.5 * (1.0 - 0.6)  # while the prior saw the rejection too


def _feed(t: AcceptanceTable, rng: np.random.Generator, rows: list[int], steps: int, reuse: bool = True) -> None:
    """Steps of random drafts and accepted counts for a random subset of rows; with `reuse`, a row released and
    reused between two folds now and then (its old steps count for the prior only)."""
    for step in range(steps):
        subset = rng.choice(rows, size=int(rng.integers(1, len(rows) + 1)), replace=False).tolist()
        drafts = rng.integers(0, K + 1, len(subset)).tolist()
        t.observe_step([(r, d, int(rng.integers(0, d + 1))) for r, d in zip(subset, drafts) if d])
        if reuse and step % 7 == 3:
            row = int(rng.choice(rows))
            t.release(row)
            assert t.acquire(K, bool(rng.integers(0, 2))) == row


@pytest.mark.parametrize("seed", range(3))
def test_a_small_block_folds_as_the_whole_table_does(seed: int) -> None:
    """A small block is folded in plain Python, a large one as whole-table operations: the same estimates."""
    few, many = (AcceptanceTable(AdaptiveConfig(max_k=K, max_rows=16)) for _ in range(2))
    few.FEW_OBSERVATIONS, few.FEW_ROWS, many.FEW_OBSERVATIONS = 10**9, 10**9, 0
    rows = [few.acquire(K, True) for _ in range(12)]
    assert [many.acquire(K, True) for _ in range(12)] == rows
    for fold in range(6):
        for table in (few, many):
            _feed(table, np.random.default_rng([seed, fold]), rows, 20)
            table.now += 1
            table.flush()
        np.testing.assert_allclose(few.p, many.p, rtol=1e-12)
        np.testing.assert_allclose(few.n, many.n, rtol=1e-12)
        np.testing.assert_allclose(few.prior_list, many.prior_list, rtol=1e-12)
        assert few.drafted_at == many.drafted_at
        np.testing.assert_allclose(few.scores, many.scores, rtol=1e-9)
        assert few.scored == many.scored and few.strength == many.strength
    assert min(few.scores) > 0.0
    assert not np.allclose(few.p[:, rows], few.config.initial_acceptance)  # the blocks moved the estimates


def test_a_few_rows_are_gathered_for_the_chooser_as_the_whole_table_does() -> None:
    """fold() reads a few rows one by one in plain Python, many with whole-table operations: the same gains,
    base and floor, adaptive and fixed rows and caps alike."""
    few, many = (AcceptanceTable(AdaptiveConfig(max_k=K, max_rows=16)) for _ in range(2))
    few.FEW_ROWS, many.FEW_ROWS = 10**9, 0
    rng = np.random.default_rng(7)
    caps, adaptive = rng.integers(0, K + 1, 10).tolist(), (rng.random(10) < 0.6).tolist()
    rows = [t.acquire(c, a) for c, a in zip(caps, adaptive) for t in (few, many)][::2]
    for table in (few, many):
        _feed(table, np.random.default_rng(8), rows, 30, reuse=False)
        table.flush()
    for subset in (rows, rows[:1], rows[3:7]):
        (gains_a, base_a, floor_a), (gains_b, base_b, floor_b) = few.fold(np.array(subset)), many.fold(np.array(subset))
        np.testing.assert_allclose(gains_a, gains_b, rtol=1e-12)
        assert base_a == pytest.approx(base_b, rel=1e-12) and floor_a == floor_b
    assert floor_a == max(c for c, a, r in zip(caps, adaptive, rows) if not a and r in rows[3:7])


def _learned_strength(acceptance_of_request: list[float], seed: int = 0) -> float:
    """The strength a table learns from requests of 40 steps one after another, the i-th's drafts each accepted
    with probability acceptance_of_request[i % len(...)], folded every 8 steps (a dwell)."""
    t = AcceptanceTable(AdaptiveConfig(max_k=K, max_rows=4))
    rng = np.random.default_rng(seed)
    for request in range(60):
        row, q = t.acquire(K, True), acceptance_of_request[request % len(acceptance_of_request)]
        for step in range(40):
            accepted = int(np.argmin(np.append(rng.random(K) < q, False)))
            t.observe_step([(row, K, accepted)])
            if step % 8 == 7:
                t.flush()
        t.release(row)
    assert t.scored >= t.MIN_SCORED
    return t.strength


def test_the_pull_toward_the_prior_is_learned_from_how_well_it_predicts() -> None:
    """Where every request accepts alike, a request's own few observations are noise: the prior predicts better and
    the learned strength is high. Where requests differ (0.1 or 0.9 a draft), their own estimates predict better,
    and it is low. (Fixed at 5, noise alone sent requests at T = 1 to k = 0 or 1 for 84-734 steps of a c = 1
    cell on the H200, run 267.)"""
    assert min(_learned_strength([0.6], seed) for seed in range(3)) >= 30.0
    assert max(_learned_strength([0.1, 0.9], seed) for seed in range(3)) <= 3.0
