"""The adaptive-speculation chooser's probes over time (docs/design.md §9): a position no request drafts is drafted
now and then, k - 1 is probed to draw what a draft costs the host, a probe whose k loses makes the next one wait
longer, and the return from a probe holds as a kept choice does."""

from __future__ import annotations

import dataclasses
import itertools
import operator

import numpy as np

from mtpserve.cluster.paired_probe import SIDE
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.spec_config import AdaptiveConfig
from mtpserve.cluster.step_costs import StepCosts
from tests.cluster.chooser_sim import COSTS, K, spec_with


def _one_request(step_seconds: float) -> tuple[AdaptiveSpec, np.ndarray]:
    """One request at 0.5 a position, whose best k is 2 (k = 3 a little behind), probing position 3 after 16 steps."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=8, max_dwell=32, probe_after=8,
                                       max_probe_wait=8))
    for k, cost in enumerate([1.0, 1.2, 1.3, 1.4, 2.0]):
        spec.costs.seed(1, k, cost * step_seconds)
    row = np.array([spec.admit(K, True)])
    spec.acceptance.set(row, np.full((K, 1), 0.5))
    # Each choice priced at 0.2 ms, not at its wall-clock time: one slow on a loaded machine stretched a dwell.
    spec._dwell = lambda choice_seconds, step_seconds: AdaptiveSpec._dwell(spec, 200e-6, step_seconds)
    return spec, row


def _probes(ks: list[int], frm: int) -> list[int]:
    """The steps at which a probe from k = frm to frm + 1 began."""
    return [i for i in range(1, len(ks)) if ks[i - 1] == frm and ks[i] == frm + 1]


def test_probes_whose_k_loses_wait_twice_as_long_each_time_up_to_the_cap() -> None:
    spec, row = _one_request(1.0)  # steps so long that no choice's own time stretches a dwell past min_dwell
    ks = [spec.choose(row) for _ in range(900)]
    assert set(ks) == {2, 3}
    probes = _probes(ks, 2)
    # waits of 16 steps (2 x probe_after below the modules), 32, 64, then 128 for good, each after a probe of 8
    assert probes[0] == 16 and np.diff(probes).tolist()[:5] == [8 + 32, 8 + 64, 8 + 128, 8 + 128, 8 + 128]


def test_a_choice_that_moves_probes_at_the_base_rate_again() -> None:
    spec, row = _one_request(1.0)
    for _ in range(300):
        spec.choose(row)
    assert spec._probe_wait == 8  # probes of k = 3 kept losing
    spec.acceptance.set(row, np.full((K, 1), 0.9))  # now k = 3 pays
    ks = [spec.choose(row) for _ in range(200)]
    moved = ks.index(3)
    assert moved <= 32 and 2 not in ks[moved:]
    assert _probes(ks, 3)[0] - moved <= 16 + 8  # position 4 probed after the base wait, not 8 x that


def test_the_return_from_a_lost_probe_holds_as_a_kept_choice() -> None:
    """Choices dear next to the steps: a kept k holds max_dwell steps. Checked again after min_dwell, the return to
    k = 2 had been a third full choice per probe."""
    spec, row = _one_request(1e-9)
    ks = [spec.choose(row) for _ in range(300)]
    first = _probes(ks, 2)[0]
    back = first + ks[first:].index(2)
    assert back - first == 8  # the probe lasts min_dwell steps
    assert ks[back: back + 32] == [2] * 32  # the return holds max_dwell (32) steps


def _one_request_at_a_time_at(p: list[float], probe_after: int, seed: int = 0) -> float:
    """Requests of 120 steps one after another, the i-th's positions each accepted with probability p[i] (the
    last p for the rest), on the H100's device costs at c = 1 and T = 1 (overlapped with a 0.25 ms host
    share); -> expected tokens per second over the best k's, after the first five requests."""
    device = np.array([0.235, 0.384, 0.437, 0.616, 0.615]) * 1e-3
    lap = np.maximum(device, 0.25e-3)
    rng = np.random.default_rng(seed)
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=1, max_dwell=8, probe_after=probe_after))
    for k, seconds in enumerate(device):
        spec.costs.seed(1, k, seconds)
    got = best = 0.0
    for request in range(30):
        q = p[min(request, len(p) - 1)]
        tokens = 1.0 + np.concatenate(([0.0], np.cumsum(q ** np.arange(1, K + 1))))
        spec.choose(np.empty(0, dtype=np.int64), batch=1)  # as the engine's: the newcomer's prefill step
        rows = np.array([spec.admit(K, True)])
        for _ in range(120):
            k = spec.choose(rows)
            accepted = np.argmin(np.append(rng.uniform(size=k) < q, False))
            spec.acceptance.observe(rows, np.array([k]), np.array([accepted]))
            spec.costs.observe(1, k, device[k], 0.25e-3, overlapped=True, tokens=1.0 + accepted, lap=lap[k])
            if request >= 5:
                got, best = got + tokens[k] / lap[k], best + (tokens / lap).max()
        spec.release(int(rows[0]))
    return got / best


def test_one_request_at_a_time_keeps_drafting_where_drafts_pay() -> None:
    """At c = 1 a prior moved per step was the last requests' history: a run of rejections pulled it low, the
    next requests started at k = 0, where nothing is observed, and every later one stayed there (0.91 of the
    best k's rate at 0.62 a position, where k = 2 is 14 % faster). Moved per observation, it holds."""
    assert min(_one_request_at_a_time_at([0.62], probe_after=10**9, seed=s) for s in range(3)) >= 0.95


def test_a_position_no_request_drafts_is_drafted_now_and_then() -> None:
    """After requests whose drafts do not pay (0.1 a position) the prior is low and every request runs k = 0,
    where nothing is observed: when acceptance rises (0.8), only drafting such a position for one dwell every
    probe_after steps lets the prior learn it. Where drafts do not pay (0.2), the probes cost little."""
    shift = [0.1] * 8 + [0.8]
    assert _one_request_at_a_time_at(shift, probe_after=10**9) < 0.8
    assert _one_request_at_a_time_at(shift, probe_after=AdaptiveConfig.probe_after) >= 0.9
    assert _one_request_at_a_time_at([0.2], probe_after=AdaptiveConfig.probe_after) >= 0.98


def test_a_probe_lasts_one_dwell_and_the_choice_returns_to_the_k_before_it() -> None:
    """Probing k + 1 must not move the choice there by itself: with hysteresis held to the probe, a k + 1 within
    the margin stayed (at T = 1, c = 1 on the H100 auto then ran k = 4 in a quarter of its steps, 0.89 of the
    best k's speed)."""
    p = np.tile([0.8, 0.5, 0.3, 0.3], (8, 1))  # rates at 10 % a draft: 1, 1.64, 1.67, 1.62, 1.56 (k = 2 best)
    spec, rows = spec_with(p, COSTS, hysteresis=0.05)
    assert spec.choose(rows) == 2
    # Nobody drafted position 3 since; a probe within the modules waits twice probe_after (for newcomers).
    spec.acceptance.now += 2 * spec.config.probe_after + 1
    assert spec.choose(rows) == 3  # the probe
    assert spec.choose(rows) == 2  # k = 3 is within the margin of k = 2, not beyond it
    assert [spec.choose(rows) for _ in range(8)] == [2] * 8  # and the next probe waits its turn


def test_a_newcomer_to_an_empty_batch_takes_a_due_probe_and_the_next_choice_returns_to_k() -> None:
    """A newcomer prefills the chain it starts with, so it drafts one more position at no catch-up: the probe of a
    position nobody drafted for probe_after steps is taken there, for one dwell, and the hysteresis holds to
    the k before it (later in a request the probe rewinds it: 13 catch-ups a cell at T = 1, c = 1, run 267)."""
    p = np.tile([0.8, 0.5, 0.3, 0.3], (8, 1))  # k = 2 best, as in the test above
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=16, hysteresis=0.05, min_dwell=4))
    for k, seconds in enumerate(COSTS):
        spec.costs.observe(8, k, seconds)
    spec.acceptance.prior_list[:] = p[0].tolist()  # the engine-wide prior learned from earlier requests
    empty = np.empty(0, dtype=np.int64)
    assert spec.choose(empty, batch=8) == 2  # position 3 drafted lately: no probe
    spec.acceptance.now += spec.config.probe_after + 1
    assert spec.choose(empty, batch=8) == 3  # the probe, well before a full choice would take it (2 x probe_after)
    rows = np.array([spec.admit(K, True) for _ in range(8)])
    spec.acceptance.set(rows, p.T)
    ks = [spec.choose(rows) for _ in range(spec.config.min_dwell + 2)]
    assert ks[: spec.config.min_dwell - 1] == [3] * (spec.config.min_dwell - 1) and ks[-1] == 2, ks


def test_a_full_choice_probes_past_the_modules_sooner_than_within_them() -> None:
    """Past the modules a draft reruns the last one and nothing lags: its probe costs no catch-up and comes
    after probe_after steps; within them, after twice that."""
    p = np.tile([0.9, 0.9, 0.9, 0.05], (8, 1))  # k = 3 best

    def probe_comes_after(modules: int) -> int:
        # max_dwell 1: a choice slow on a loaded machine would otherwise hold k a step more and shift the probe.
        spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=0, max_dwell=1, modules=modules))
        rows = np.array([spec.admit(K, True) for _ in range(8)])
        spec.acceptance.set(rows, p.T)
        for j, seconds in enumerate(COSTS):
            spec.costs.observe(8, j, seconds)
        assert spec.choose(rows) == 3
        waited = 0
        while spec.choose(rows) == 3:
            spec.acceptance.now += 64
            waited += 64
        return waited

    after = AdaptiveConfig.probe_after  # steps of 64 from here on, one more each choice
    assert after - 64 < probe_comes_after(modules=2) <= after  # position 4 past the modules
    assert 2 * after - 64 < probe_comes_after(modules=4) <= 2 * after  # within them


def test_a_probe_lasts_min_dwell_steps_however_long_the_dwell_has_grown() -> None:
    """The dwell grows to max_dwell where choices are dear next to the steps; a probe held that long, every
    probe_after steps, ran a third of a simulated c = 8 at the probed k."""
    p = np.tile([0.8, 0.5, 0.3, 0.3], (8, 1))
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=4, max_dwell=64))
    rows = np.array([spec.admit(K, True) for _ in range(8)])
    spec.acceptance.set(rows, p.T)
    for k, seconds in enumerate(COSTS):
        spec.costs.observe(8, k, seconds)
    spec._dwell = lambda choice_seconds, step_seconds: 64  # a choice as dear as the longest dwell allows
    while spec.k != 2:
        spec.choose(rows)
    spec.acceptance.now += 2 * spec.config.probe_after + 64
    ks = [spec.choose(rows) for _ in range(72)]  # the probe comes at the next full choice, 64 steps on
    assert ks.count(3) == 4 and ks[ks.index(3) + 4] == 2, ks


def _host_bound_run(modules: int, steps: int = 480, seed: int = 0, draft_us: float = 10.0) -> list[int]:
    """A batch of 8 whose drafts are accepted at 0.95 / 0.9 / 0.85 / 0.2 (reach per position), served one step
    after the other, each step costing the host 20 us a request + 2 us a token + draft_us a request and draft,
    and the device 100 + 10 k us (the start-up seeds say so exactly). Best at 10 us: k = 3 (10 % ahead of k = 4);
    priced without the host's draft term, k = 4 looks 3 % ahead. -> the k of every step."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=8, max_dwell=64, modules=modules))
    # Each choice costs the host 200 us (about what it takes here), not the time it took: paced by the latter, the
    # dwells grew on a loaded machine and the probes came later than the steps this simulates.
    spec._dwell = lambda choice_seconds, step_seconds: AdaptiveSpec._dwell(spec, 200e-6, step_seconds)
    rows = np.array([spec.admit(K, True) for _ in range(8)])
    reach = np.array([0.95, 0.9, 0.85, 0.2])
    p = reach / np.concatenate(([1.0], reach[:-1]))  # conditional acceptance per position
    spec.acceptance.set(rows, np.tile(p, (8, 1)).T)
    for k in range(K + 1):
        spec.costs.seed(8, k, 1e-6 * (100 + 10 * k))
    rng, ks = np.random.default_rng(seed), []
    for _ in range(steps):
        k = spec.choose(rows)
        hits = np.concatenate((rng.uniform(size=(8, k)) < p[:k], np.zeros((8, 1), bool)), axis=1)
        accepted = np.argmin(hits, axis=1)
        spec.acceptance.observe(rows, np.full(8, k), accepted)
        emitted = float(8 + accepted.sum())
        spec.costs.observe(8, k, 1e-6 * (100 + 10 * k), host=1e-6 * (8 * 20 + 2 * emitted + 8 * draft_us * k),
                           tokens=emitted)
        ks.append(k)
    return ks


def test_a_k_past_the_modules_probes_k_minus_1_and_learns_what_a_draft_costs_the_host() -> None:
    """Dwelling on one k, the host line could not draw a draft's host cost and priced every k at the host level
    of its own: at c = 128 on the H100 auto ran k = 4 throughout where fixed k = 3 ran 5 % faster (run 214).
    With 3 modules, k = 4 recurses on the last one, so k = 3 is probed for a dwell (no module falls behind)
    and the line draws the draft term. (At k = 3, within the modules, k = 2 is then probed until DRAFT_DRAWS
    probes drew the price below them, a host window or more apart, each draw_dwell steps: over by the last 200 of
    1200 steps.)"""
    ks = _host_bound_run(modules=3, steps=1200)
    assert 3 in ks[:120]  # probed once k = 4 had held for a host window
    assert ks[-200:].count(3) >= 180, ks[-200:]  # and chosen once three probes drew the price alike


def test_a_k_within_the_modules_probes_k_minus_1_until_the_draft_price_is_drawn() -> None:
    """Within the modules a probe costs a catch-up when k rises again, but without one the price of a draft below
    them was never drawn: at T = 1, c = 8 on a slow H200 host auto dwelt on k = 3, host-bound, pricing k = 1 and 2
    at 1.17x and 1.12x their real laps (run 300). So k - 1 is probed until DRAFT_DRAWS probes drew it, then no
    more: the line keeps what they drew."""
    ks = _host_bound_run(modules=K, steps=1000)
    assert ks[-200:].count(3) >= 180, ks[-200:]  # found k = 3, as over 3 modules
    free = _host_bound_run(modules=K, steps=1500, draft_us=0.0)  # a draft costs the host nothing: k = 4 is best
    probes = [i for i, k in enumerate(free) if k < K and (i == 0 or free[i - 1] == K)]
    assert 1 <= len(probes) <= StepCosts.DRAFT_DRAWS, probes
    assert free[-600:] == [K] * 600  # the price drawn: no probe since


def test_probes_below_and_past_the_modules_last_draw_dwell_steps() -> None:
    """A probe below the modules draws the host's price of a draft for the rest of the run from its timed steps: of
    min_dwell's 3 or 4 the draws at T = 1, c = 8 on the H200 read 0 to 9.7 us where the price was about 8 (run 307).
    It lasts draw_dwell steps, and so does a probe past the modules (drawn A/B/A since session AL): of min_dwell's
    steps too few were timed, and most such probes drew nothing (runs 327 and 331, replayed)."""
    config = AdaptiveConfig(max_k=K, max_rows=8)
    runs = [(k, len(list(steps))) for k, steps in itertools.groupby(_host_bound_run(modules=3, steps=1200))]
    below = [n for (k, n), (before, _) in zip(runs[1:], runs) if before == 3 and k == 2]
    past = [n for (k, n), (before, _), (after, _) in zip(runs[1:], runs, runs[2:]) if before == 4 == after and k == 3]
    assert below and all(n == config.draw_dwell for n in below), runs
    assert past and all(n == config.draw_dwell for n in past), runs


def _accepting_spec(adaptive: list[bool], device_us: float) -> tuple[AdaptiveSpec, np.ndarray]:
    """A chooser (3 modules, max_k 4) over requests accepting every draft at 0.95, adaptive or at a fixed k = 4,
    each k seeded at device_us + 10 k us for their batch."""
    n = len(adaptive)
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=n, min_dwell=8, max_dwell=64, modules=3))
    rows = np.array([spec.admit(K, a) for a in adaptive])
    spec.acceptance.set(rows, np.full((K, n), 0.95))
    for k in range(K + 1):
        spec.costs.seed(n, k, 1e-6 * (device_us + 10 * k))
    return spec, rows


def _probe_steps(fixed: int, timed_at_chosen_k: bool, steps: int = 600) -> list[int]:
    """The steps whose k auto probed below 4 (3 modules), 8 requests accepting every draft at 0.95, of them
    `fixed` at a fixed k = 4; each step's host sample is recorded at the k the step ran (max of auto's and the
    fixed requests'), or, with timed_at_chosen_k False, always at 4 (as if every probe's steps went untimed)."""
    spec, rows = _accepting_spec([i >= fixed for i in range(8)], device_us=100.0)
    probes = []
    for step in range(steps):
        k = spec.choose(rows)
        ran = max(k, K if fixed else 0) if timed_at_chosen_k else K
        spec.acceptance.observe(rows, np.full(8, ran), np.full(8, ran))
        spec.costs.observe(8, ran, 1e-6 * (100 + 10 * ran), host=1e-6 * (160 + 2 * 8 * (1 + ran)), tokens=8 * (1 + ran))
        if k < K:
            probes.append(step)
    return probes


def test_no_probe_below_k_where_a_fixed_request_runs_k_anyway() -> None:
    """The step runs the largest fixed k whatever auto chooses: a probe there gathers nothing, and with nothing
    gathered it came back at every choice (a review found it: 272 of 600 steps at the probed k)."""
    assert _probe_steps(fixed=1, timed_at_chosen_k=True) == []
    assert _probe_steps(fixed=0, timed_at_chosen_k=True) != []


def test_probes_that_gather_no_sample_are_spaced_by_a_host_window() -> None:
    probes = _probe_steps(fixed=0, timed_at_chosen_k=False)
    starts = [s for i, s in enumerate(probes) if i == 0 or probes[i - 1] != s - 1]
    assert len(starts) >= 2 and min(b - a for a, b in zip(starts, starts[1:])) >= StepCosts.HOST_WINDOW


def _overlapped_run(host: float, steps: int = 600) -> list[int]:
    """One request accepting every draft at 0.95, k = 4 past its 3 modules, overlapped steps whose device takes
    (290 + 10 k) us and whose host takes `host` seconds; -> the k of every step."""
    spec, rows = _accepting_spec([True], device_us=290.0)
    ks = []
    for _ in range(steps):
        k = spec.choose(rows)
        device = 1e-6 * (290 + 10 * k)
        spec.acceptance.observe(rows, np.array([k]), np.array([k]))
        spec.costs.observe(1, k, device, host=host, overlapped=True, tokens=1.0 + k, lap=max(host, device) + 5e-6)
        ks.append(k)
    return ks


def test_no_probe_below_k_where_the_host_waits_for_the_device_at_both() -> None:
    """A probe of k - 1 past the modules draws the host's price of a draft, which cannot move a step whose host
    waits for its device: at c = 1, greedy on the H200 such probes ran 3 % of auto's steps at k = 3 (run 275)."""
    assert _overlapped_run(host=250e-6)[-500:] == [K] * 500  # 0.25 ms of host under k = 3's 0.32 ms of device
    assert 3 in _overlapped_run(host=325e-6)[-500:]  # a host about as slow as the device: probed


def test_past_the_modules_a_settled_price_is_probed_again_wherever_k_ran_a_probes_side() -> None:
    """A probe past the modules is paired (A/B/A), so it needs SIDE samples at k before it, not a window of k alone:
    waiting for such a window, three early draws of about twice the price held auto between k = 3 and 4 at greedy
    c = 256 on the H200, and the price was never drawn again (run 332)."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, modules=3, probe_after=64))
    costs, b = spec.costs, spec.costs.bucket(8)
    costs.host_recursion_slopes[b] = 4e-6  # settled by earlier probes
    for k, n in ((3, 40), (4, SIDE - 1)):
        for _ in range(n):
            spec.acceptance.now += 1
            costs.observe(8, k, 1e-4, host=8 * 30e-6, tokens=8 * (1 + 0.8 * k))
    spec.k = 4
    assert spec._probe_down(4, 8, floor=0) == 4  # one sample short of a probe's side at k
    spec.acceptance.now += 1
    costs.observe(8, 4, 1e-4, host=8 * 30e-6, tokens=8 * 4.2)
    assert costs.one_k_run(8, 4) == SIDE < spec.config.probe_after
    assert spec._probe_down(4, 8, floor=0) == 3
    assert spec._probe_down(4, 8, floor=0) == 4  # the next one probe_after steps on


def _due_probe_down(fourth: float, token_price: float | None = 3e-6) -> int:
    """The choice of k = 4 past 3 modules at greedy c = 8, a probe of k - 1 due, the fourth draft accepted at
    `fourth` after three at 0.95, the host's price of a token drawn at `token_price` (None: not drawn)."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, modules=3, probe_after=64))
    costs = spec.costs
    costs.host_recursion_slopes[costs.bucket(8)] = 1e-6  # settled by earlier probes
    costs.tokens.price = token_price
    for k, n in ((3, 40), (4, SIDE)):
        for _ in range(n):
            spec.acceptance.now += 1
            costs.observe(8, k, 1e-4, host=8 * 30e-6, tokens=8 * (1 + 0.8 * k))
    costs.refit(8)  # as the steps before a full choice fit it (AdaptiveSpec._prepare)
    spec.k = 4
    reach = itertools.accumulate([0.95, 0.95, 0.95, fourth], operator.mul)
    return spec._probe_down(4, 8, floor=0, priced=(8, [8 * r for r in reach], 8.0))


def test_no_probe_past_the_modules_where_k_wins_with_its_drafts_priced_as_tokens() -> None:
    """A draft costs the host at most a token (cap_drafts): where k = 4 keeps the best rate with its draft past the
    modules at that price, no draw can move the choice, and a probe costs its steps' tokens and three full choices
    (greedy c = 8 on the H200: 456 of auto's learned steps at k = 3, 8-14 % fewer tokens a ms, run 352)."""
    assert _due_probe_down(fourth=0.95) == 4
    assert _due_probe_down(fourth=0.05) == 3  # the fourth draft pays about as much as it may cost: probed
    assert _due_probe_down(fourth=0.95, token_price=None) == 3  # nothing bounds the price: probed


def test_settings_the_step_costs_read_follow_a_changed_config() -> None:
    """benchmarks/interleaved.py runs an auto variant by replacing its chooser's config after the engine is built."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, modules=3))
    assert spec.costs.bound_recursion is True and spec.costs.cap_drafts is True
    spec.config = dataclasses.replace(spec.config, bound_recursion=False)
    assert spec.costs.bound_recursion is False and not spec.config.bound_recursion
    spec.config = dataclasses.replace(spec.config, cap_drafts=False)
    assert spec.costs.cap_drafts is False and spec.costs.bound_recursion is False
