"""The benchmark host's CPU: a plain-Python speed probe, and pinning the driving thread to one fast core.

At high concurrency an engine step is host-bound (docs/design.md §9), so the core that runs the step loop
sets a cell's speed. On the H100 machine the cores did not run alike: pinned in turn, six of sixteen took
3.5-4.1 ms for the probe below and the rest 2.2-2.4 (benchmarks/host_speed.py, session U), and an unpinned
process that moved between them ran the same cell up to 1.7x slower from one cell to the next; one process
that stayed on one core ran the same cell within 1-3 % each time. `--pin-cpu auto` (spec_matrix.py,
cell_phases.py, step_costs.py, engine_profile.py) probes every core this process started with and pins the
driving thread to the fastest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def host_probe() -> float:
    """Milliseconds of a fixed piece of plain Python (dicts, lists, ints, strings: what a step's host work is
    made of), the best of three."""
    def work() -> int:
        d = {i: i * 3 for i in range(20000)}
        return sum(v for k, v in d.items() if k % 3) + len([str(i) for i in range(5000)])

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        work()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


# The cores the process was started with: once pin_cpu has pinned it, sched_getaffinity names one core only.
ALLOWED_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def core_samples(rounds: int, probes: int = 1) -> dict[int, list[float]]:
    """Per core the process was started with, `probes` probes pinned to it in each of `rounds` passes over the
    cores (ms). Leaves the affinity as it found it."""
    found = os.sched_getaffinity(0)
    samples: dict[int, list[float]] = {cpu: [] for cpu in ALLOWED_CORES}
    try:
        for _ in range(rounds):
            for cpu in ALLOWED_CORES:
                os.sched_setaffinity(0, {cpu})
                samples[cpu] += [host_probe() for _ in range(probes)]
    finally:
        os.sched_setaffinity(0, found)
    return samples


def core_speeds(rounds: int = 2) -> dict[int, float]:
    """Per core the process was started with, the median of `rounds` probes pinned to it (ms)."""
    return {cpu: statistics.median(t) for cpu, t in core_samples(rounds).items()}


def add_pin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pin-cpu", default="auto",
                   help="pin the thread that drives the engine to one core: 'auto' (the fastest by a plain-Python "
                        "probe), a core number, or 'none'")


def pin_cpu(choice: str) -> str:
    """Pin the calling thread (threads it starts later inherit it) as --pin-cpu says; returns a note for the
    results."""
    if choice == "none" or not hasattr(os, "sched_setaffinity"):
        return "driving thread not pinned"
    if choice != "auto":
        os.sched_setaffinity(0, {int(choice)})
        return f"driving thread pinned to core {int(choice)} (probe {host_probe():.2f} ms)"
    speeds = core_speeds()
    best = min(speeds, key=speeds.__getitem__)
    os.sched_setaffinity(0, {best})
    return (f"driving thread pinned to core {best}, the fastest by a plain-Python probe ({speeds[best]:.2f} ms; "
            f"{len(speeds)} cores {min(speeds.values()):.2f}-{max(speeds.values()):.2f} ms)")
