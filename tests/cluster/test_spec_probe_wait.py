"""The adaptive-speculation chooser's probes over time (docs/design.md §9): a probe whose k loses makes the next one
wait longer, and the return from it holds as a kept choice does."""

from __future__ import annotations

import numpy as np

from mtpserve.cluster.spec_chooser import AdaptiveConfig, AdaptiveSpec
from tests.cluster.chooser_sim import K


def _one_request(step_seconds: float) -> tuple[AdaptiveSpec, np.ndarray]:
    """One request at 0.5 a position, whose best k is 2 (k = 3 a little behind), probing position 3 after 16 steps."""
    spec = AdaptiveSpec(AdaptiveConfig(max_k=K, max_rows=8, min_dwell=8, max_dwell=32, probe_after=8,
                                       max_probe_wait=8))
    for k, cost in enumerate([1.0, 1.2, 1.3, 1.4, 2.0]):
        spec.costs.seed(1, k, cost * step_seconds)
    row = np.array([spec.admit(K, True)])
    spec.acceptance.set(row, np.full((K, 1), 0.5))
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
