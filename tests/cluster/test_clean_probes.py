"""Clean probes (AdaptiveConfig.clean_probes, docs/design.md §9): a probe of k - 1 draws the host's price of a draft
from steps in one stretch without prompt chunks or catch-ups (StepCosts.interrupt)."""

from __future__ import annotations

import dataclasses

from mtpserve.cluster.paired_probe import SETTLE, SIDE
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.spec_config import AdaptiveConfig
from mtpserve.cluster.step_costs import StepCosts
from tests.cluster.chooser_sim import K

BATCH = 8


def _steps(costs: StepCosts, k: int, n: int, host_us: float = 30.0) -> None:
    """n timed decode steps of BATCH requests at k, each request `host_us` of host and 1 + 0.8 k tokens."""
    for _ in range(n):
        costs.observe(BATCH, k, 1e-4, host=BATCH * host_us * 1e-6, tokens=BATCH * (1 + 0.8 * k))


def _clean(max_k: int = K) -> StepCosts:
    costs = StepCosts(max_k=max_k, max_rows=BATCH, modules=3)
    costs.clean_probes = True
    return costs


def test_a_run_starts_again_past_an_interruption_and_its_first_sample() -> None:
    costs = _clean()
    _steps(costs, 4, 20)
    assert costs.clean_run(BATCH, 4) == 20 and costs.clean_run(BATCH, 3) == 0
    costs.interrupt(admitted=True)
    assert costs.clean_run(BATCH, 4) == 0  # nothing since
    _steps(costs, 4, 5)
    assert costs.clean_run(BATCH, 4) == 5 - SETTLE
    _steps(costs, 3, 2)
    assert costs.clean_run(BATCH, 4) == 0 and costs.clean_run(BATCH, 3) == 2
    costs.clean_probes = False  # off: a run of one k, interruptions or not
    costs.interrupt(admitted=True)
    assert costs.clean_run(BATCH, 3) == costs.one_k_run(BATCH, 3) == 2


def test_the_before_side_is_taken_from_the_clean_run_alone() -> None:
    """The previous wave's last steps (slow here) are not the before side of a probe opened in the next."""
    costs = _clean()
    _steps(costs, 4, SIDE, host_us=40.0)  # the previous wave
    costs.interrupt(admitted=True)
    _steps(costs, 4, SETTLE + 5, host_us=30.0)
    costs.begin_probe(BATCH, 4)
    probe = costs._probes[costs.bucket(BATCH)]
    assert len(probe.before) == 5 and all(abs(h - 30e-6) < 1e-12 for h, _ in probe.before)


def test_an_admission_voids_a_probe_and_a_catch_up_restarts_its_after_side() -> None:
    costs = _clean()
    b = costs.bucket(BATCH)
    _steps(costs, 4, SIDE)
    costs.begin_probe(BATCH, 4)
    _steps(costs, 3, 4)
    costs.interrupt(admitted=True)  # requests joined during the probe: its sides straddle another batch
    assert costs._probes[b] is None
    _steps(costs, 4, SIDE)
    costs.begin_probe(BATCH, 4)
    _steps(costs, 3, 4)
    _steps(costs, 4, 3, host_us=60.0)  # back at k: steps around its catch-ups run slow
    costs.interrupt(admitted=False)  # a catch-up
    probe = costs._probes[b]
    assert probe is not None and probe.after == []
    _steps(costs, 4, SETTLE + SIDE)
    assert costs._probes[b] is None  # complete: drawn from the samples past the catch-up
    assert costs._draft_draws[b] or costs._recursion_draws[b]


def test_a_probe_waits_for_a_clean_run_of_side_samples() -> None:
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=BATCH, modules=3, probe_after=64, clean_probes=True))
    costs = spec.costs
    assert costs.clean_probes
    _steps(costs, 4, 40)
    costs.interrupt(admitted=True)
    _steps(costs, 4, SIDE)  # one short of SIDE once the first is skipped
    spec.k = 4
    assert costs.one_k_run(BATCH, 4) >= SIDE and costs.clean_run(BATCH, 4) == SIDE - SETTLE
    assert spec._probe_down(4, BATCH, floor=0) == 4
    _steps(costs, 4, SETTLE)
    assert spec._probe_down(4, BATCH, floor=0) == 3


def test_off_by_default_and_set_with_the_config() -> None:
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=BATCH, modules=3))
    assert spec.costs.clean_probes is False
    spec.config = dataclasses.replace(spec.config, clean_probes=True)
    assert spec.costs.clean_probes is True
