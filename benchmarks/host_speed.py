#!/usr/bin/env python
"""Does this machine's host run at one speed? A plain-Python probe over time, on whatever core the OS
picks and pinned to each core in turn.

    python benchmarks/host_speed.py --seconds 20

A step of the engine at high concurrency is host-bound (design §9), so a host whose speed moves moves
every benchmark cell with it: on the H100 machine the same cell ran 1.5-2x slower from one cell to the
next, every host phase alike (cell_phases.py's probe read ~2.6 or ~4.5 ms). This times the same probe
(host.host_probe) back to back, unpinned, with the core each ran on, then pinned to each core in
turn; and prints what the kernel says of the cores (SMT siblings, frequency, steal time) where it says it.
Diagnosis, no RESULTS section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import host  # noqa: E402


def current_cpu() -> int:
    """The core this thread last ran on (/proc/self/stat field 39; -1 where it cannot be read)."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def steal_jiffies() -> int:
    """Time stolen from this guest by its hypervisor, all cores (/proc/stat; -1 where not reported)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) if len(fields) > 8 else -1
    except (OSError, ValueError):
        return -1


def describe_cores() -> None:
    """What the kernel says of the cores: SMT siblings, frequency scaling, model and clock."""
    for what, path in (("SMT siblings of cpu0", "/sys/devices/system/cpu/cpu0/topology/thread_siblings_list"),
                       ("scaling governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")):
        try:
            print(f"{what}: {Path(path).read_text().strip()}")
        except OSError:
            print(f"{what}: not reported")
    try:
        mhz = [line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        model = next(line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
        print(f"cpu: {model}; MHz per core: {' '.join(mhz)}")
    except (OSError, StopIteration):
        print("cpu: /proc/cpuinfo not readable")


def over_time(seconds: float) -> None:
    """Probes back to back; per second, the median and the cores they ran on."""
    t_end, t0, steal0 = time.perf_counter() + seconds, time.perf_counter(), steal_jiffies()
    per_second: dict[int, list[tuple[float, int]]] = defaultdict(list)
    while time.perf_counter() < t_end:
        ms = host.host_probe()
        per_second[int(time.perf_counter() - t0)].append((ms, current_cpu()))
    for second, samples in sorted(per_second.items()):
        times = [ms for ms, _ in samples]
        cores = sorted({cpu for _, cpu in samples})
        print(f"  t={second:3d}s  probe median {statistics.median(times):.2f} ms  min {min(times):.2f}  "
              f"max {max(times):.2f}  cores {cores}")
    steal1 = steal_jiffies()
    print(f"  steal: {steal1 - steal0 if steal0 >= 0 <= steal1 else 'not reported'} jiffies over {seconds:.0f} s")


def per_core(rounds: int, probes: int) -> None:
    print("  core: probe median ms (min - max)")
    for cpu, t in host.core_samples(rounds, probes).items():
        print(f"  {cpu:4d}: {statistics.median(t):.2f} ({min(t):.2f} - {max(t):.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="how long to probe unpinned")
    p.add_argument("--rounds", type=int, default=3, help="passes over every core, pinned")
    p.add_argument("--probes", type=int, default=5, help="probes per core and pass")
    args = p.parse_args(argv)
    describe_cores()
    print(f"unpinned, {args.seconds:.0f} s:")
    over_time(args.seconds)
    print(f"pinned to each core in turn, {args.rounds} passes of {args.probes} probes:")
    per_core(args.rounds, args.probes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
