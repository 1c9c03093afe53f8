"""benchmarks/host.py: the driving thread pinned to the fastest core, chosen among every core the process started
with, however often it is chosen again (once pinned, the affinity itself names one core)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="os.sched_setaffinity exists on Linux only: no core to pin to here")


@pytest.fixture(autouse=True)
def _restore_affinity() -> Iterator[None]:
    found = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, found)


def _probe_by_core(fast: int):
    """A probe that reads 1 ms on core `fast` and 3 ms on every other."""
    return lambda: 1.0 if os.sched_getaffinity(0) == {fast} else 3.0


def test_auto_pins_to_the_fastest_core_each_time_it_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = host.ALLOWED_CORES
    for fast in (cores[-1], cores[0]):  # the second choice must still see every core, not the one pinned first
        monkeypatch.setattr(host, "host_probe", _probe_by_core(fast))
        note = host.pin_cpu("auto")
        assert os.sched_getaffinity(0) == {fast}
        assert f"core {fast}" in note and f"{len(cores)} cores" in note


def test_a_named_core_and_none(monkeypatch: pytest.MonkeyPatch) -> None:
    before = os.sched_getaffinity(0)
    assert host.pin_cpu("none") == "driving thread not pinned" and os.sched_getaffinity(0) == before
    host.pin_cpu(str(host.ALLOWED_CORES[0]))
    assert os.sched_getaffinity(0) == {host.ALLOWED_CORES[0]}


def test_core_speeds_leaves_the_affinity_as_it_found_it() -> None:
    before = os.sched_getaffinity(0)
    speeds = host.core_speeds(rounds=1)
    assert set(speeds) == set(host.ALLOWED_CORES) and all(ms > 0 for ms in speeds.values())
    assert os.sched_getaffinity(0) == before
