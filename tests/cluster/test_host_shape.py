"""HostShape: the host's share per request at each k relative to k = 0, from k, k', k again."""

from __future__ import annotations

import numpy as np

from mtpserve.cluster.host_shape import HostShape

K = 4


def _feed(shape: HostShape, ks: list[int], host: list[float], bucket: int = 0) -> None:
    for k, h in zip(ks, host):
        shape.observe(bucket, k, h)


def test_k_then_k_minus_one_then_k_measures_their_ratio_through_a_drifting_host() -> None:
    """The host slows down steadily by 1 % a step while k goes 3, 2, 3: the drift cancels, the ratio stays."""
    shape = HostShape(K, 1)
    ks = [3] * 10 + [2] * 8 + [3] * 8
    true = np.array([1.0, 1.3, 1.5, 1.7, 1.9])
    _feed(shape, ks, [true[k] * 1.01**i for i, k in enumerate(ks)])
    assert shape.measured(2, 3) and not shape.measured(3, 4)
    scale = shape.scale()
    assert abs(scale[3] / scale[2] - 1.7 / 1.5) < 0.01
    np.testing.assert_allclose(scale[[0, 1]] / scale[2], 1.0, atol=0.01)  # unmeasured: level with the neighbour
    assert abs(scale[4] / scale[3] - 1.0) < 0.01


def test_one_switch_that_meets_a_jump_of_the_hosts_speed_measures_nothing() -> None:
    """k = 0 on a fast host, then k = 4 on one twice as slow: a comparison of the two would read the host's
    jump as the price of four drafts. Only k, k', k again is a measurement."""
    shape = HostShape(K, 1)
    _feed(shape, [0] * 16 + [4] * 16, [1.0] * 16 + [2.0] * 16)
    assert not shape.pairs
    np.testing.assert_array_equal(shape.scale(), np.ones(K + 1))


def test_segments_must_be_contiguous_long_enough_and_in_one_bucket() -> None:
    shape = HostShape(K, 2)
    _feed(shape, [3] * 8 + [2] * 3 + [3] * 8, [1.0] * 8 + [0.5] * 3 + [1.0] * 8)  # k' too short
    assert not shape.pairs
    _feed(shape, [2] * 8, [0.5] * 8)
    _feed(shape, [1] * (HostShape.GAP + 1), [9.0] * (HostShape.GAP + 1), bucket=1)  # another bucket between
    _feed(shape, [3] * 8, [1.0] * 8)
    assert not shape.pairs
    _feed(shape, [2] * 8 + [3] * 8, [0.5] * 8 + [1.0] * 8)  # now 3, 2, 3 in a row
    assert shape.measured(2, 3)
    assert abs(np.log(shape.scale()[3] / shape.scale()[2]) - np.log(2.0)) < 1e-9


def test_a_pair_is_the_median_of_its_last_measurements_and_ages() -> None:
    shape = HostShape(K, 1)
    for ratio in (1.2, 1.2, 5.0):  # one measurement spoiled by a GC pause inside the probe
        _feed(shape, [1] * 8 + [2] * 8 + [1] * 8, [1.0] * 8 + [ratio] * 8 + [1.0] * 4)
    assert abs(shape.scale()[2] / shape.scale()[1] - 1.2) < 1e-9
    _feed(shape, [1] * (HostShape.STALE + 1), [1.0] * (HostShape.STALE + 1))
    assert not shape.measured(1, 2)  # the chooser probes it again; the shape keeps it meanwhile
    assert abs(shape.scale()[2] / shape.scale()[1] - 1.2) < 1e-9


def test_the_fit_joins_pairs_measured_apart() -> None:
    """Auto probing its way down, k = 4 to 1: each pair is measured on its own, the fit chains them."""
    shape, true = HostShape(K, 1), np.array([1.0, 1.4, 1.4 * 1.1, 1.4 * 1.1**2, 1.4 * 1.1**3])
    for k in range(K, 0, -1):
        ks = [k] * 8 + [k - 1] * 8 + [k] * 8
        _feed(shape, ks, true[ks])
    assert all(shape.measured(k - 1, k) for k in range(1, K + 1))
    np.testing.assert_allclose(shape.scale(), true, rtol=1e-6)
