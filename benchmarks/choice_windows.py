#!/usr/bin/env python
"""What auto's choices cost in steps: the untimed stretches around them, counted from a GPU run's samples.

    python benchmarks/interleaved.py --ks 1,2,3,4,auto --concurrency 8 --temperature 1 --dump-samples s.json.gz
    python benchmarks/choice_windows.py s.json.gz

A full choice does its work in the step that makes it and, a piece each, in the three before it
(AdaptiveSpec._prepare). The engine learns no step cost from a lap that carried much of that work, so those steps are
missing from the samples. Between two timed steps of the full batch at the same k, a stretch of m untimed steps
took `seconds`; at the lap of the steps around it (their median) it would have taken m laps. Per variant this
sums the stretches that held a choice and no request's admission (whose prompt step costs more than a lap) and,
apart, those that held no choice (prompt steps, a capture: what every variant has), and sets the time beyond m laps
against the variant's whole time in its cells.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_samples  # noqa: E402

Record = dict[str, Any]
NEIGHBOURS = 8  # timed steps on each side whose median lap prices a stretch's steps


class Stretch(NamedTuple):
    """Untimed steps between two timed full-batch steps at the same k."""

    chose: bool  # a choice was made within it
    admitted: bool  # a request was admitted within it (its prompt step is among the steps)
    steps: int
    seconds: float
    lap: float  # the median lap of the timed steps around it

    @property
    def extra(self) -> float:
        """Seconds beyond what its steps would have taken at the laps around them."""
        return self.seconds - self.steps * self.lap


def stretches(records: list[Record], variant: str, c: int) -> list[Stretch]:
    """The variant's stretches at batch c, round by round (records in the order the engine made them)."""
    by_round: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        if r["variant"] == variant and r["kind"] in ("sample", "choice"):
            by_round[r["round"]].append(r)
    out = []
    for rows in by_round.values():
        samples = [r for r in rows if r["kind"] == "sample"]
        choices = [r["t"] for r in rows if r["kind"] == "choice"]
        for i in range(1, len(samples)):
            a, b = samples[i - 1], samples[i]
            steps = b["step"] - a["step"] - 1
            if steps < 1 or a["batch"] != c or b["batch"] != c or a["k"] != b["k"]:
                continue
            around = [s["lap"] for s in samples[max(i - NEIGHBOURS, 0): i + NEIGHBOURS]
                      if s["batch"] == c and s["k"] == a["k"]]
            chose = any(a["t"] < t < b["t"] for t in choices)
            admitted = b.get("admitted", 0) != a.get("admitted", 0)  # dumps before the count: none seen
            out.append(Stretch(chose, admitted, steps, b["t"] - b["lap"] - a["t"], statistics.median(around)))
    return out


def cell_seconds(records: list[Record], variant: str) -> float:
    """The variant's time in its cells: per round, from its first sample's lap to its last sample."""
    spans: dict[int, list[float]] = {}
    for r in records:
        if r["variant"] == variant and r["kind"] == "sample":
            span = spans.setdefault(r["round"], [r["t"] - r["lap"], r["t"]])
            span[1] = r["t"]
    return sum(end - start for start, end in spans.values())


def summary(records: list[Record], variant: str, c: int) -> dict[str, float]:
    """Per kind of stretch ("choice": a choice and no prompt step, what the choices cost; "other": no choice):
    stretches, steps, extra seconds, extra laps per stretch and the extra's share of the variant's cell time; and
    "choices" per cell. Stretches that hold both a choice and a prompt step (at c = 1 a newcomer's choice is made in
    its prompt step) are in neither."""
    found = stretches(records, variant, c)
    total = cell_seconds(records, variant)
    rounds = {r["round"] for r in records if r["variant"] == variant and r["kind"] == "sample"}
    out: dict[str, float] = {"choices per cell": sum(r["kind"] == "choice" and r["variant"] == variant
                                                     for r in records) / max(len(rounds), 1)}
    for kind, mine in (("choice", [s for s in found if s.chose and not s.admitted]),
                       ("other", [s for s in found if not s.chose])):
        extra = sum(s.extra for s in mine)
        out.update({f"{kind} stretches": len(mine), f"{kind} steps": sum(s.steps for s in mine),
                    f"{kind} extra s": extra,
                    f"{kind} extra laps each": statistics.mean(s.extra / s.lap for s in mine) if mine else 0.0,
                    f"{kind} extra share": extra / total if total else 0.0})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dump", help="a JSON file written by --dump-samples (its samples carry the engine's step count)")
    args = p.parse_args(argv)
    records = cost_samples.load(args.dump)
    variants = sorted({r["variant"] for r in records if r["kind"] == "sample"})
    print("variant | choices per cell | stretches with a choice and no prompt step: n, steps, extra laps each, extra "
          "share of the cells' time | stretches without a choice: the same")
    for variant in variants:
        s = summary(records, variant, int(variant.split("c=")[1]))
        print(f"{variant} | {s['choices per cell']:.1f} | " + " | ".join(
            f"{s[f'{k} stretches']:.0f}, {s[f'{k} steps']:.0f}, {s[f'{k} extra laps each']:.2f}, "
            f"{100 * s[f'{k} extra share']:.2f} %" for k in ("choice", "other")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
