#!/usr/bin/env python
"""How the host's share of a decode step grows as the requests grow, what detokenization costs it, and auto's.

    python benchmarks/host_growth.py --concurrency 256 --ks 4 --max-tokens 512 --waves 8   # GPU if any
    python benchmarks/host_growth.py --concurrency 128 --ks 4,auto --detok table --engine-per-k --max-tokens 1000
    python benchmarks/host_growth.py --device cpu --concurrency 16 --ks 3 --max-tokens 128 --waves 2

Waves of --concurrency requests of --max-tokens tokens each (eos ignored, greedy) run one after another, after a
short warm-up wave per k. Every step is timed, and so is the cyclic garbage collector (gc.callbacks). The waves take
each pair of --ks and --detok in turn, on one engine (an auto one where auto is among --ks) or, with --engine-per-k,
on an engine built for each k, as interleaved.py builds its variants. --detok names the detokenizers: `table` looks
each token's bytes up (cluster/byte_level.py, the engine's default for a byte-level tokenizer), `window` decodes two
windows a request and step through the tokenizer (every other tokenizer's path, and byte-level ones' before session
AN). The first wave of each pair runs two windows of --window steps under cProfile, one early and one late (the
functions that grew, and those that cost most; with two pairs, their profiles side by side); the tok/s of the
unprofiled waves after them, interleaved in one process, compare the pairs. On the H200 at c = 256 the host-bound
lap grew from about 5.5 ms to 8 ms within a 512-token wave (run 337), and the window path's two `decode` calls a
request took 1.4-1.9 ms of a step (run 338); the table made 1.25x the window path's tok/s (run 339).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402

AUTO = "auto"


class GcClock:
    """Seconds the cyclic collector ran since `reset`."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def reset(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out

    def close(self) -> None:
        gc.callbacks.remove(self._on)


class Wave:
    """One wave's step laps, GC seconds per step, wall time and tokens, and its profiled windows (if any)."""

    def __init__(self, k: int | str, detok: str) -> None:
        self.k, self.detok, self.laps, self.gcs, self.wall, self.tokens = k, detok, [], [], 0.0, 0
        self.profiles: dict[str, pstats.Stats] = {}


def submit(engine: LLMEngine, tag: str, c: int, max_tokens: int, prompt_len: int, k: int | str) -> None:
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, num_speculative_tokens=k)
    for i in range(c):
        engine.add_request(f"{tag}{i}", rng.integers(1000, 2000, prompt_len).tolist(), params)


def run_wave(engine: LLMEngine, args: argparse.Namespace, w: Wave, tag: str, starts: dict[int, str],
             clock: GcClock) -> None:
    submit(engine, tag, args.concurrency, args.max_tokens, args.prompt_len, w.k)
    prof, left = None, 0
    t_wave = time.perf_counter()
    while engine.has_unfinished_requests():
        name = starts.get(len(w.laps))
        if name is not None:
            prof, left = cProfile.Profile(), args.window
            w.profiles[name] = prof  # type: ignore[assignment]
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        outs = engine.step()
        if prof is not None:
            prof.disable()
            left -= 1
            prof = prof if left else None
        w.laps.append(time.perf_counter() - t0)
        w.tokens += sum(len(o.new_token_ids) for o in outs)
        w.gcs.append(clock.reset())
    w.wall = time.perf_counter() - t_wave
    w.profiles = {name: pstats.Stats(p) for name, p in w.profiles.items()}  # type: ignore[arg-type]


def engines(args: argparse.Namespace) -> dict[int | str, LLMEngine]:
    """The engine each k's waves run on: one for all (an auto engine where auto is among them), or with
    --engine-per-k one per k built for it, as benchmarks/interleaved.py builds its variants'."""
    def build(k: int | str) -> LLMEngine:
        return LLMEngine(EngineConfig(device=args.device, num_speculative_tokens=k, max_num_seqs=args.concurrency))
    if args.engine_per_k:
        return {k: build(k) for k in args.ks}
    shared = build(AUTO if AUTO in args.ks else max(args.ks))
    return {k: shared for k in args.ks}


def run(args: argparse.Namespace) -> list[Wave]:
    by_k = engines(args)
    tokenizers = {id(e.outputs.tokenizer): e.outputs.tokenizer for e in by_k.values()}
    if None in tokenizers.values():
        raise SystemExit("the model has no tokenizer.json: nothing is detokenized")
    tables = {i: t.byte_table for i, t in tokenizers.items()}
    if "table" in args.detok and None in tables.values():
        raise SystemExit("--detok table: this tokenizer is not byte-level (no byte table)")
    for k, engine in by_k.items():
        submit(engine, f"warm{k}-", args.concurrency, 16, args.prompt_len, k)
        while engine.has_unfinished_requests():
            engine.step()
    if args.gc == "freeze":
        gc.freeze()  # everything alive now (the engines, the model) leaves the collector's generations
    elif args.gc == "off":
        gc.disable()
    clock, waves, kinds = GcClock(), [], [(k, d) for k in args.ks for d in args.detok]
    for i in range(args.waves):
        w = Wave(*kinds[i % len(kinds)])
        engine = by_k[w.k]
        tokenizer = engine.outputs.tokenizer
        tokenizer.byte_table = tables[id(tokenizer)] if w.detok == "table" else None  # read by new requests
        profiled = i < len(kinds) and args.window > 0
        run_wave(engine, args, w, f"w{i}-", dict(zip(window_starts(args), ("early", "late"))) if profiled else {},
                 clock)
        waves.append(w)
    clock.close()
    return waves


def window_starts(args: argparse.Namespace) -> tuple[int, int]:
    """The profiled windows' first steps: a tenth and three fifths into the wave's full-batch steps (at full
    acceptance a wave takes max_tokens / (k + 1) steps, so the late window ends before the first request does)."""
    expected = args.max_tokens // (max(k for k in args.ks if k != AUTO) + 1 if args.ks != [AUTO] else 5)
    early = max(4, expected // 10)
    return early, max(int(expected * 0.6), early + args.window)


def growth(stats: dict[str, pstats.Stats], window: int, top: int) -> list[tuple[str, float, float, int, int]]:
    """(function, early us/step, late us/step, early calls/step, late calls/step): the `top` that grew most, then
    the `top` with the most own time late."""
    per: dict[str, dict[str, tuple[float, int]]] = {}
    for name, st in stats.items():
        for (path, line, fn), (_, calls, tottime, _, _) in st.stats.items():  # type: ignore[attr-defined]
            per.setdefault(f"{Path(path).name}:{line}({fn})", {})[name] = (tottime / window * 1e6, calls // window)
    rows = [(f, v.get("early", (0, 0))[0], v.get("late", (0, 0))[0], v.get("early", (0, 0))[1],
             v.get("late", (0, 0))[1]) for f, v in per.items()]
    return sorted(rows, key=lambda r: r[1] - r[2])[:top] + sorted(rows, key=lambda r: -r[2])[:top]


def tenths(w: Wave, skip: set[int]) -> str:
    """Median lap (ms) of each tenth of the wave's steps, the profiled steps left out."""
    n = len(w.laps)
    size = max(1, n // 10)
    cells = []
    for i in range(0, n, size):
        laps = [w.laps[j] for j in range(i, min(n, i + size)) if j not in skip] or w.laps[i : i + size]
        cells.append(f"{statistics.median(laps) * 1e3:.2f}")
    return " ".join(cells)


def tables(args: argparse.Namespace, waves: list[Wave]) -> list[Table]:
    title = f"host growth: c = {args.concurrency}, {args.max_tokens} tokens a request, gc {args.gc}"
    profiled = {s + i for s in window_starts(args) for i in range(args.window)}
    per_wave = Table(title + ": each wave (median lap per tenth of its steps; profiled waves' windows left out)",
                     ["wave", "k", "detok", "profiled", "steps", "tok/s", "gc ms/step", "median lap ms by tenths"])
    for i, w in enumerate(waves):
        prof = bool(w.profiles)
        per_wave.add(i, str(w.k), w.detok, "yes" if prof else "no", len(w.laps), f"{w.tokens / w.wall:.0f}",
                     f"{np.mean(w.gcs) * 1e3:.3f}", tenths(w, profiled if prof else set()))
    out = [per_wave]
    unprofiled = [w for w in waves if not w.profiles]
    kinds = sorted({(str(w.k), w.detok) for w in unprofiled})
    if len(kinds) > 1:
        ab = Table(title + ": unprofiled waves by k and detokenizer", ["k", "detok", "waves", "median tok/s",
                                                                        "over the first row's"])
        rates = {kind: [w.tokens / w.wall for w in unprofiled if (str(w.k), w.detok) == kind] for kind in kinds}
        base = statistics.median(rates[kinds[0]])
        for (k, d), r in rates.items():
            ab.add(k, d, len(r), f"{statistics.median(r):.0f}", f"{statistics.median(r) / base:.3f}")
        out.append(ab)
    profiled_waves = [w for w in waves if w.profiles]
    for w in profiled_waves:
        grown = Table(title + f", k = {w.k}, detok {w.detok}: own time per step, early window against late "
                      f"({args.window} steps each): the {args.top} that grew most, then the {args.top} with the most "
                      "late", ["function", "early us/step", "late us/step", "late - early", "calls/step early", "late"])
        for f, early, late, ce, cl in growth(w.profiles, args.window, args.top):
            grown.add(f, f"{early:.1f}", f"{late:.1f}", f"{late - early:+.1f}", ce, cl)
        out.append(grown)
    if len(profiled_waves) == 2:
        out.append(compared(title, profiled_waves, args))
    return out


def compared(title: str, waves: list[Wave], args: argparse.Namespace) -> Table:
    """Own time per step over both windows of two profiled waves, the functions that differ most first."""
    a, b = ({f: (t, n) for f, _, t, _, n in growth({"late": merged(w)}, 2 * args.window, 10**9)} for w in waves)
    names = [f"k = {w.k}, {w.detok}" for w in waves]
    table = Table(title + f": own time per step, {names[1]} against {names[0]} (both windows)",
                  ["function", f"{names[0]} us/step", f"{names[1]} us/step", "difference", "calls/step",
                   "calls/step (2nd)"])
    rows = sorted(set(a) | set(b), key=lambda f: -abs(b.get(f, (0, 0))[0] - a.get(f, (0, 0))[0]))
    for f in rows[: args.top]:
        (ta, na), (tb, nb) = a.get(f, (0.0, 0)), b.get(f, (0.0, 0))
        table.add(f, f"{ta:.1f}", f"{tb:.1f}", f"{tb - ta:+.1f}", na, nb)
    return table


def merged(w: Wave) -> pstats.Stats:
    """Both profiled windows of a wave as one."""
    first, *rest = w.profiles.values()
    both = copy.copy(first)  # Stats.add merges into its own dict: the wave's stay as they are
    both.stats = dict(first.stats)
    return both.add(*rest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--ks", default="4", help="the waves' k in turn (an int or auto): 4,auto compares the two")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--waves", type=int, default=6)
    p.add_argument("--engine-per-k", action="store_true",
                   help="an engine per k, built for it (as interleaved.py's variants), instead of one for all")
    p.add_argument("--detok", default="table,window", help="detokenizers the waves take in turn (table, window)")
    p.add_argument("--window", type=int, default=20, help="steps per profiled window (0: no profile)")
    p.add_argument("--gc", choices=("on", "off", "freeze"), default="on",
                   help="the cyclic collector during the waves: as it is, disabled, or after gc.freeze()")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, concurrency=4, max_tokens=64, window=4, waves=4, top=5)
    args.detok = args.detok.split(",")
    args.ks = [k if k == AUTO else int(k) for k in args.ks.split(",")]
    if not set(args.detok) <= {"table", "window"}:
        p.error(f"--detok: table or window, got {args.detok}")
    common.report(args, "host_growth", common.pick_device(args.device), tables(args, run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
