"""The adaptive-speculation chooser over time (docs/design.md §9): how long a choice holds (the dwell), a choice per
batch bucket while a batch ramps up or drains, newcomers to an empty batch, and a choice's work spread over the steps
before it (the k it picks: test_spec_chooser.py; its probes: test_spec_probes.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mtpserve.cluster.acceptance import AcceptanceTable
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.spec_config import AdaptiveConfig
from mtpserve.cluster.step_costs import StepCosts
from tests.cluster.chooser_sim import K


def test_full_choices_are_paced_by_the_dwell_even_when_k_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full choice (fold, cost table, argmax) costs host time; made every step once k had held for a dwell,
    it doubled auto's step at c = 1 on the H100."""
    # max_dwell 8: a choice slower than 0.1 s (a loaded machine) would stretch the dwell past min_dwell.
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=4, min_dwell=8, max_dwell=8))
    rows = np.array([spec.admit(K, True) for _ in range(4)])
    spec.acceptance.set(rows, np.ones((K, 4)))  # always accepted: k stays K
    for k in range(K + 1):
        spec.costs.seed(4, k, 1.0 + 0.1 * k)  # every k timed: no exploration
    folds = []
    fold = AcceptanceTable.fold
    monkeypatch.setattr(AcceptanceTable, "fold", lambda self, r, **kw: (folds.append(1), fold(self, r, **kw))[1])
    assert {spec.choose(rows) for _ in range(64)} == {K}
    assert len(folds) == 64 // 8


def test_the_dwell_grows_until_choices_cost_a_small_share_of_the_steps() -> None:
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=4, min_dwell=8, max_dwell=64, choice_share=0.02))
    assert spec._dwell(0.4e-3, 0.5e-3) == 40  # a 0.4 ms choice over 0.5 ms steps (the H100's host at c = 1)
    assert spec._dwell(0.05e-3, 0.5e-3) == 8 and spec._dwell(1.0, 1e-3) == 64
    rows = np.array([spec.admit(K, True) for _ in range(4)])
    spec.acceptance.set(rows, np.ones((K, 4)))
    for k in range(K + 1):
        spec.costs.seed(4, k, 1e-7 * (1 + k))  # steps far cheaper than any choice: the longest dwell
    for _ in range(200):
        spec.choose(rows)
    assert spec.dwell == 64


def test_a_new_k_is_checked_again_after_min_dwell_and_a_kept_one_ever_later() -> None:
    """Paced by the choice's cost alone (~0.4 ms on the H100's host against 0.3 ms steps at c = 8), the
    first choice of a greedy cell held k = 2 for 128 steps before k = 4, where fixed k = 4 ran 20 % faster
    (run 140). A choice that changes k holds for min_dwell steps; one that keeps k holds as long as its cost
    allows (doubled from min_dwell instead, a c = 8 cell made 13-20 full choices of ~1.1 ms, runs 167-168)."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=4, min_dwell=8, max_dwell=64, hysteresis=0.0,
                                       probe_after=10**6))  # no probe of an undrafted position
    rows = np.array([spec.admit(K, True) for _ in range(4)])
    for k in range(K + 1):
        spec.costs.seed(4, k, 1e-7 * (1 + 0.1 * k))  # choices cost far more than steps: the cost allows max_dwell

    def choices(steps: int) -> list[tuple[int, int]]:
        made = []
        for _ in range(steps):
            k = spec.choose(rows)
            if spec._held == 0:  # a full choice was made this call
                made.append((k, spec.dwell))
        return made

    spec.acceptance.set(rows, np.ones((K, 4)))
    assert choices(1 + 64 + 64) == [(K, 64), (K, 64), (K, 64)]  # the first call chooses; a kept k holds long
    spec.acceptance.set(rows, np.zeros((K, 4)))  # drafts stop paying: the next choice falls to 0 ...
    assert choices(64 + 8) == [(0, 8), (0, 64)]  # ... is checked again after min_dwell, then holds long


def test_a_choice_made_while_the_batch_ramps_up_holds_only_for_its_bucket() -> None:
    """Requests admitted a few dozen a step: a choice made at 32 rows must not hold for a long dwell once
    the batch is 256, where other costs apply."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=256, min_dwell=8, max_dwell=128))
    for k in range(K + 1):
        spec.costs.seed(32, k, 1e-3 * (1 + 3 * k))  # at 32 rows drafts cost more than they earn: k = 0
        spec.costs.seed(256, k, 1e-3 * (1 + 0.05 * k))  # at 256 they are nearly free: k = K
    rows = np.array([spec.admit(K, True) for _ in range(256)])
    spec.acceptance.set(rows, np.full((K, 256), 0.8))
    spec.dwell = spec.config.max_dwell
    assert spec.choose(rows[:32]) == 0
    spec.dwell = spec.config.max_dwell  # as a slow choice would set it
    ks = [spec.choose(rows[:48]) for _ in range(spec.config.min_dwell)]  # the next bucket: after min_dwell
    assert ks[-1] == K and ks.count(0) == spec.config.min_dwell - 1
    spec.acceptance.set(rows[:1], np.zeros((K, 1)))  # a drained batch of one whose drafts fail: k = 0 ...
    assert spec.choose(rows[:1]) == 0 and spec._held == 0
    assert spec.choose(rows) == K  # ... and the next 256 requests, chosen for at once: their prefill runs K


def test_a_ramping_batch_is_chosen_for_the_batch_it_will_reach() -> None:
    """32 requests run and 224 wait to join: the k chosen now is the k their prefills run with, so it is priced
    at 256 rows, where drafts are nearly free, not at 32, where they cost more than they earn (chosen for the
    32, the joining requests prefilled without their chains and were all caught up a few steps later)."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=256))
    for k in range(K + 1):
        spec.costs.seed(32, k, 1e-3 * (1 + 3 * k))
        spec.costs.seed(256, k, 1e-3 * (1 + 0.05 * k))
    rows = np.array([spec.admit(K, True) for _ in range(32)])
    spec.acceptance.set(rows, np.full((K, 32), 0.8))
    assert spec.choose(rows) == 0
    spec.dwell = 0  # the next call chooses again
    assert spec.choose(rows, batch=256) == K
    spec.dwell = 0
    assert spec.choose(rows, batch=8) == 0  # never below the rows running


def test_waiting_requests_that_never_join_do_not_make_the_chooser_explore_for_good() -> None:
    """8 requests run and 56 wait (the KV cache is full: they cannot join). Prices come from the bucket of
    64, but steps land in the bucket of 8: a k - 1 that is 'untimed' must be judged where the samples land,
    or every choice would go down to time it and every rise would cost a catch-up."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=64))
    rows = np.array([spec.admit(K, True) for _ in range(8)])
    spec.acceptance.set(rows, np.full((K, 8), 0.95))
    ks = []
    for _ in range(12):
        spec.dwell = 0  # choose every call
        ks.append(spec.choose(rows, batch=64))
        for _ in range(4):
            spec.costs.observe(8, ks[-1], 1e-3 * (1 + 0.05 * ks[-1]))
    assert ks.count(K - 1) <= 1 and ks[-1] == K, ks


def test_a_burst_after_an_idle_spell_is_chosen_for_before_its_prefills() -> None:
    """Nothing runs and 256 requests wait: the k their prefills run is chosen for them now (from the engine's
    prior acceptance and the costs at 256 rows), not left over from the drained batch before (k = 0 there)."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=256))
    for k in range(K + 1):
        spec.costs.seed(1, k, 1e-3 * (1 + 3 * k))  # one request at a time: drafts cost more than they earn
        spec.costs.seed(256, k, 1e-3 * (1 + 0.05 * k))
    row = np.array([spec.admit(K, True)])
    spec.acceptance.set(row, np.full((K, 1), 0.8))
    assert spec.choose(row) == 0
    spec.release(int(row[0]))
    assert spec.choose(np.array([], dtype=np.int64), batch=256) == K
    assert spec.choose(np.array([], dtype=np.int64)) == K  # nothing waits either: the last choice stays


def test_newcomers_to_an_empty_batch_start_from_the_prior_not_from_the_last_requests_k() -> None:
    """One request at a time (c = 1): each arrives to an empty batch. It starts at the bucket's last choice for
    newcomers (made from the engine-wide prior, no full choice per request), not at the k the last request's own
    estimates chose: after a request whose drafts were all rejected (k = 0), the next one had started at k = 0
    and observed nothing there (run 237: 621 steps of a T = 1, c = 1 round at k = 0). Past max_dwell steps the
    newcomers' choice is made again, from the costs as they are then."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=8))
    for k in range(K + 1):
        spec.costs.seed(1, k, 1e-3 * (1 + 0.05 * k))
    empty = np.array([], dtype=np.int64)
    assert spec.choose(empty, batch=1) == K  # the prior (0.8 a position) pays for every draft
    row = np.array([spec.admit(K, True)])
    spec.acceptance.set(row, np.zeros((K, 1)))  # this request's drafts are never accepted
    assert [spec.choose(row) for _ in range(spec.dwell)][-1] == 0
    spec.release(int(row[0]))
    assert spec.choose(empty, batch=1) == K  # the next request: the newcomers' k, not the last one's 0
    for k in range(1, K + 1):
        spec.costs.seed(1, k, 1e-3 * (1 + 5 * k))  # drafts now cost far more than they earn
    made = spec._newcomers_of[spec.costs.bucket(1)][1]
    spec.acceptance.now = made + spec.config.max_dwell - 1
    assert spec.choose(empty, batch=1) == 0  # max_dwell steps on: chosen again


def test_fixed_k_newcomers_to_an_empty_batch_make_no_choice() -> None:
    """A fixed-k request arriving to an empty batch has nothing to choose: no full choice is made for it (a
    fixed-k cell at c = 1 made one per request, run 180), and the next adaptive newcomer is chosen for."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8))
    for k in range(K + 1):
        spec.costs.seed(1, k, 1e-3 * (1 + 5 * k))  # drafts cost far more than they earn
    empty = np.array([], dtype=np.int64)
    spec._held = spec.dwell  # any last choice is over
    assert spec.choose(empty, batch=1, newcomers_adaptive=False) == K and spec.chosen.sum() == 0
    assert not spec.active and spec._held == spec.dwell + 1
    assert spec.choose(empty, batch=1) == 0 and spec.chosen[0] == 1 and spec._held == 0


def _newcomers_after(last_k: int, ms: list[float]) -> int:
    """The newcomers' k for an empty batch of 8 (3 modules, the initial prior of 0.8 a position: 1, 1.8, 2.44, 2.95
    and 3.36 tokens a request at k = 0..4) where the last newcomers' choice, max_dwell steps ago, was last_k and the
    steps at each k now cost `ms` milliseconds."""
    spec, empty = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=16, modules=3)), np.array([], dtype=np.int64)
    assert spec.acceptance.prior_list[:K] == [0.8] * K
    for k in range(K + 1):
        spec.costs.seed(8, k, 1e-3 * (0.2 if k == last_k else 5.0))
    assert spec.choose(empty, batch=8) == last_k
    for k, seconds in enumerate(ms):
        spec.costs.seed(8, k, seconds * 1e-3)
    spec.acceptance.now += spec.config.max_dwell  # that choice no longer holds
    return spec.choose(empty, batch=8)


def test_newcomers_to_an_empty_batch_are_held_by_the_free_hysteresis_unless_they_fall_below_the_modules() -> None:
    """Nothing of the newcomers' has run, so no switch from the last newcomers' k catches any of them up: the 5 %
    that guards a catch-up within the modules does not hold them there. Held by it, the T = 1, c = 256 rounds on the
    H200 started from the ninth on at k = 2, the newcomers' k carried over from round to round, where k = 3 was
    priced 2-3 % ahead, and every request lagged a module from its first position (run 318). A fall below the
    modules leaves one behind for the whole batch: the 5 %."""
    rate_3 = 2.44 * 1.03  # k = 3 3 % ahead of k = 2, k = 4 5 % behind k = 3
    assert _newcomers_after(2, [0.9, 0.95, 1.0, 2.952 / rate_3, 3.3616 * 1.05 / rate_3]) == 3
    rate_3 = 2.44 * 1.005  # 0.5 %: within the free hysteresis
    assert _newcomers_after(2, [0.9, 0.95, 1.0, 2.952 / rate_3, 3.3616 * 1.05 / rate_3]) == 2
    rate_2 = 2.952 * 1.03  # k = 2 3 % ahead of k = 3, the modules
    assert _newcomers_after(3, [0.5, 0.7, 2.44 / rate_2, 1.0, 2.0]) == 3
    assert _newcomers_after(3, [0.5, 0.7, 2.44 / (2.952 * 1.06), 1.0, 2.0]) == 2  # 6 %: past the 5 %


def test_a_batch_back_in_a_bucket_whose_choice_holds_takes_it_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """At c = 1 the next request joins while the last one finishes: the batch goes 1 -> 2 -> 1. The step at
    two is chosen for (another bucket, other costs); back at one, that bucket's choice still holds and is
    taken up again without a full choice (two full choices per request before, run 171)."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=8, max_dwell=64, probe_after=10**6))
    for k in range(K + 1):
        spec.costs.seed(1, k, 1e-7 * (1 + 0.1 * k))  # one request: drafts pay (choices cost more than steps)
        spec.costs.seed(2, k, 1e-7 * (1 + 5.0 * k))  # two: they do not
    row = np.array([spec.admit(K, True)])
    spec.acceptance.set(row, np.full((K, 1), 0.9))
    folds = []
    fold = AcceptanceTable.fold
    monkeypatch.setattr(AcceptanceTable, "fold", lambda self, r, **kw: (folds.append(1), fold(self, r, **kw))[1])
    assert [spec.choose(row) for _ in range(20)] == [K] * 20 and len(folds) == 1 and spec.dwell == 64
    assert spec.choose(row, batch=2) == 0 and len(folds) == 2  # a request waits to join: chosen for two
    assert spec.choose(row) == K and len(folds) == 2  # back at one: its choice holds, no full choice
    assert spec.dwell == 64 and spec._held == 21


def test_a_probe_taken_up_again_in_its_bucket_still_returns_to_its_k() -> None:
    """A bucket's remembered choice carries the k its probe left: without it, the next choice there held the
    probed k + 1 by the hysteresis, as if it were the current choice."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=8, max_dwell=64, probe_after=4))
    for k, cost in enumerate([1.0, 1.2, 1.3, 1.4, 2.0]):  # at p = 0.5 k = 2 is best, k = 3 0.5 % behind
        spec.costs.seed(1, k, cost * 1e-3)
        spec.costs.seed(4, k, 1e-3 * (1 + 5 * k))  # at four requests drafts do not pay
    row = np.array([spec.admit(K, True)])
    spec.acceptance.set(row, np.full((K, 1), 0.5))
    assert spec.choose(row) == 2
    assert [spec.choose(row) for _ in range(8)][-1] == 3  # k = 2 kept: position 3 is probed
    assert spec.choose(row, batch=4) == 0  # two buckets away: chosen for at once
    assert spec.choose(row) == 3  # back within the probe's dwell: it is taken up again ...
    assert [spec.choose(row) for _ in range(8)][-1] == 2  # ... and the choice after it returns to k = 2


def test_the_chooser_prices_a_sampled_batch_with_the_sampled_costs() -> None:
    """The same acceptance, cheap greedy drafts and dear sampled ones: a greedy batch runs every draft, a
    sampled batch none; a batch that turns sampled is chosen for at once."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=16, min_dwell=8))
    for k in range(K + 1):
        spec.costs.seed(8, k, 1e-3 * (1 + 0.05 * k))
        spec.costs.seed(8, k, 1e-3 * (1 + 2.0 * k), greedy=False)
    greedy = np.array([spec.admit(K, True) for _ in range(8)])
    assert spec.choose(greedy) == K and spec.greedy
    sampled = np.array([spec.admit(K, True, greedy=False) for _ in range(8)])
    for rows in (greedy, sampled):
        spec.acceptance.set(rows, np.full((K, 8), 0.6))
    assert spec.choose(sampled) == 0 and not spec.greedy  # a new mode: no dwell to wait out
    mixed = np.concatenate((greedy[:4], sampled[:4]))  # one sampled request makes the batch's step sampled
    spec.choose(mixed)
    assert not spec.greedy


def test_a_full_choice_folds_and_fits_in_the_steps_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made whole, a choice overran the host's slack beside an overlapped step: the laps that chose ran 1.0-1.2 ms
    against a median of 0.39-0.45 at c = 1 on the H200 (run 276). Its fold and the host line's refit run in the
    steps before it, and the choice itself neither flushes nor fits."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=1, min_dwell=8, max_dwell=8))
    rows = np.array([spec.admit(K, True)])
    for k in range(K + 1):
        spec.costs.seed(1, k, 1e-6 * (300 + 10 * k))
    work: list[str] = []
    flush, fit = AcceptanceTable.flush, StepCosts._fit_slopes
    monkeypatch.setattr(AcceptanceTable, "flush", lambda self: (work.append("flush"), flush(self))[1])
    monkeypatch.setattr(StepCosts, "_fit_slopes", lambda self, *a: (work.append("fit"), fit(self, *a))[1])
    rng, steps = np.random.default_rng(0), []
    for _ in range(200):
        work.clear()
        k = spec.choose(rows)
        chose_alone = tuple(work)  # what the call did before the step's launch
        spec.prepare_due()  # as the engine does once the step is launched
        steps.append((spec.choosing, tuple(work)))
        assert chose_alone == () or spec.choosing  # a held step's piece waits for prepare_due
        accepted = int(rng.integers(0, k + 1))
        spec.acceptance.observe(rows, np.array([k]), np.array([accepted]))
        spec.costs.observe(1, k, 1e-6 * (300 + 10 * k), host=1e-6 * (200 + 5 * accepted), overlapped=True,
                           tokens=1.0 + accepted, lap=1e-6 * (310 + 10 * k))
    chose = [work for choosing, work in steps[1:] if choosing]  # the first call chooses at once
    assert len(chose) >= 20 and all(work == () for work in chose)
    assert sum(work == ("flush",) for _, work in steps) >= len(chose)  # each choice's fold, three steps before
    assert any(work == ("fit",) for _, work in steps)  # refits where due, two steps before


def test_a_choice_long_after_the_last_fold_folds_what_came_since() -> None:
    """A fold (three steps ahead of a due choice, or a choice's own) stands in for the choice's for min_dwell steps, as
    long as a held choice reads its estimates: a drain crossing a bucket every few steps folded at each crossing, most
    of each choice's time. A choice later than that folds anew, and its fold stands in for the next ones."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=1, min_dwell=8))
    rows = np.array([spec.admit(K, True)])
    spec.choose(rows)  # the first call chooses at once
    for folded_ago, left in ((10, 0), (1, 3), (8, 3), (9, 0)):  # steps from the fold to the choice: anew past 8
        for _ in range(3):
            spec.acceptance.observe(rows, np.array([K]), np.array([1]))
        spec._flushed_at = spec.acceptance.now + 1 - folded_ago  # the choice counts its own step first
        spec._held = spec.dwell  # the next call is a full choice
        spec.choose(rows)
        assert len(spec.acceptance._pending) == left
        assert spec._flushed_at == spec.acceptance.now - (0 if left == 0 else folded_ago)
        spec.acceptance.flush()
