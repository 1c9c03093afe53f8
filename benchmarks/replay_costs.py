#!/usr/bin/env python
"""Auto's priced steps against the fixed-k cells of the same rounds, replayed offline from a GPU run's samples.

    python benchmarks/interleaved.py --ks 1,2,3,4,auto --concurrency 8 --temperature 1 --dump-samples s.json
    python benchmarks/replay_costs.py s.json [--variant no-spread] [--below-full]

interleaved.py runs an engine per variant, one short cell of each per round, so a round's fixed-k cells say what
each k's steps cost and emitted while auto's engine chose. For every full choice auto made at the full batch this
sets beside each k's real mean lap and tokens a step (the fixed cells' full-batch steps in that round):
  * the cost row the engine priced, and the one a cost model replayed from the same samples prices (the model
    as it is, or a --variant of it: a what-if, run on the CPU in seconds instead of a GPU run per idea);
  * the k each row's rate picks (with the choice's own expected tokens) against the k the real laps and tokens
    pick, and the real rate lost by the pick.
A replay sees the samples auto's choices produced; a variant that would have chosen otherwise would have seen
others. So it measures pricing, not the closed loop: what it finds is then run on the GPU. --below-full looks at
auto's choices below the full batch instead (ramps, wave changes, drains): how many rows priced k = 1-3 alike and
which k each row picks, the engine's and the replay's (session AK: a price borrowed from another bucket, tried so).
At the full batch it also counts each row's picks among every k, those no fixed cell ran included, and rates them by
every variant's steps in the round, auto's own too (session AL: how it compared cost models over its dumps).
"""

from __future__ import annotations

import argparse
import base64
import pickle
import statistics
import sys
from collections import Counter, defaultdict, deque
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_samples  # noqa: E402
from mtpserve.cluster.step_costs import StepCosts  # noqa: E402

Record = dict[str, Any]


def no_spread(costs: StepCosts) -> None:
    """What-if: the host at its speed now, without the spread of its recent speeds."""
    fit = costs._host_fit

    def narrow(batch: int, refit: bool = True, recursion: float | None = None) -> tuple:
        return (*fit(batch, refit, recursion)[:4], [1.0])

    costs._host_fit = narrow  # type: ignore[method-assign]


def draft_prior(share: float) -> Callable[[StepCosts], None]:
    """What-if: where no window has drawn the host's price of a draft, each draft costs the host `share` of its
    share per request now."""
    def patch(costs: StepCosts) -> None:
        fit = costs._host_fit

        def priced(batch: int, refit: bool = True, recursion: float | None = None) -> tuple:
            a, slope, price, median, spread = fit(batch, refit, recursion)
            if not any(price) and batch > 0:
                per = share * median / batch
                price = [per * k for k in range(len(price))]
            return a, slope, price, median, spread

        costs._host_fit = priced  # type: ignore[method-assign]
    return patch


def token_price(us: float) -> Callable[[StepCosts], None]:
    """What-if: the host's price of a token fixed at `us` microseconds a request, as if drawn within steps before the
    replay starts (dumps from before session AM hold no such draws). With AdaptiveConfig.cap_drafts on (dumps since
    session AO) it also moves the drafts' cap (token-0 caps nothing)."""
    def patch(costs: StepCosts) -> None:
        costs.tokens.price = us * 1e-6  # whatever the warm-up drew before the model was pickled
        costs.tokens.add_draw = lambda drawn: None  # type: ignore[method-assign]
    return patch


def window_tokens(costs: StepCosts) -> None:
    """What-if: the token's price drawn across steps, from each bucket's window, as before session AM (each bucket's
    slope as a fresh model's where the warm-up's fits took the price drawn within steps). No price drawn within
    steps: the drafts go uncapped (AdaptiveConfig.cap_drafts)."""
    if costs.tokens.price is not None:
        costs.host_slopes = [0.0] * len(costs.host_slopes)
    costs.tokens.price = None
    costs.tokens.add_draw = lambda drawn: None  # type: ignore[method-assign]


def bound_recursion(on: bool) -> Callable[[StepCosts], None]:
    """What-if: AdaptiveConfig.bound_recursion on (the price of a draft past the modules at most the one below them) or
    off (as before session AN); a dump's cost model keeps the setting its engine ran with."""
    def apply(costs: StepCosts) -> None:
        costs.bound_recursion = on
    return apply


def cap_drafts(on: bool) -> Callable[[StepCosts], None]:
    """What-if: AdaptiveConfig.cap_drafts on (a draft's host price at most a token's) or off (as before session AO)."""
    def apply(costs: StepCosts) -> None:
        costs.cap_drafts = on
    return apply


VARIANTS: dict[str, Callable[[StepCosts], None]] = {"as-is": lambda costs: None, "no-spread": no_spread,
                                                    "cap-drafts": cap_drafts(True),
                                                    "uncapped-drafts": cap_drafts(False),
                                                    "window-tokens": window_tokens,
                                                    "bound-recursion": bound_recursion(True),
                                                    "unbound-recursion": bound_recursion(False),
                                                    **{f"draft-{s}": draft_prior(s) for s in (0.04, 0.08, 0.12)},
                                                    **{f"token-{us}": token_price(us) for us in (0, 0.3, 1, 3)}}


def upgraded(costs: StepCosts) -> StepCosts:
    """A cost model pickled by an older engine, with each field added since as a fresh model starts it (session AG
    added the probes' draws below the modules) and each bucket's deques as long as a fresh model's: dumps of earlier
    runs replay with the model as it is now."""
    fresh = StepCosts(costs.max_k, costs._sizes[-1], costs.window, modules=costs.modules)
    costs.__dict__.setdefault("bound_recursion", False)  # an engine before eb2849c ran unbounded (now a class default)
    costs.__dict__.setdefault("cap_drafts", False)  # and one before session AO uncapped
    for name, value in vars(fresh).items():
        costs.__dict__.setdefault(name, value)
        old = costs.__dict__[name]
        if isinstance(value, list) and value and isinstance(value[0], deque) and old[0].maxlen != value[0].maxlen:
            costs.__dict__[name] = [deque(d, maxlen=value[0].maxlen) for d in old]  # e.g. 5 draws since session AM
    return costs


def real_cells(records: list[Record], c: int) -> dict[tuple[int, int], tuple[float, float]]:
    """(round, k) -> (mean lap, mean tokens) of a fixed-k variant's full-batch steps in that round."""
    laps: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "sample" and "auto" not in r["variant"] and r["batch"] == c and r["lap"] > 0:
            laps[(r["round"], r["k"])].append((r["lap"], r["tokens"]))
    return {key: (statistics.mean(x for x, _ in v), statistics.mean(t for _, t in v)) for key, v in laps.items()}


def step_rates(records: list[Record], c: int, least: int = 8) -> dict[tuple[int, int], float]:
    """(round, k) -> tokens a second of every variant's full-batch steps at k in that round, auto's own among them
    (at least `least` steps): a rate for the k's no fixed cell ran, where auto ran them. Auto's steps at a k ran at
    other moments than its other k's, so a round's rates hold the host's drift; over many choices it averages out."""
    sums: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in records:
        if r["kind"] == "sample" and r["batch"] == c and r["lap"] > 0:
            cell = sums[(r["round"], r["k"])]
            cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + r["tokens"], cell[2] + r["lap"]
    return {key: tokens / lap for key, (n, tokens, lap) in sums.items() if n >= least}


def rated_picks(rows: list[tuple[Record, list[float]]], rates: dict[tuple[int, int], float]) -> dict[str, list[float]]:
    """Per row ("engine", "replay"), each choice's pick among the k's its round rated (step_rates), as a share of the
    best of them; choices whose round rated fewer than two k's are left out."""
    out: dict[str, list[float]] = {"engine": [], "replay": []}
    for choice, replayed in rows:
        rated = {k: rate for (round_, k), rate in rates.items() if round_ == choice["round"]}
        if len(rated) < 2:
            continue
        tokens = list(accumulate(choice["gains"], initial=choice["base"]))
        for label, row in (("engine", choice["cost"]), ("replay", replayed)):
            pick = max(rated, key=lambda k: tokens[k] / row[k])
            out[label].append(rated[pick] / max(rated.values()))
    return out


def replay(records: list[Record], variant: str, c: int, what_if: Callable[[StepCosts], None],
           at: Callable[[int], bool] | None = None) -> list[tuple[Record, list[float]]]:
    """Auto's choices at the full batch (or at the batches `at` accepts), each with the cost row the replayed model
    prices there. Where one engine ran every variant (cell_phases.py: its state is tagged ""), it is fed every
    variant's samples, in order."""
    own = any(r["kind"] == "state" and r["variant"] == variant for r in records)
    mine = [r for r in records if r["variant"] == variant or not own and r["kind"] != "choice"]
    state = next(r for r in mine if r["kind"] == "state")
    costs = upgraded(pickle.loads(base64.b64decode(state["costs"])))
    what_if(costs)
    greedy = all(r["greedy"] for r in mine if r["kind"] == "sample")
    out = []
    for r in mine:
        if r["kind"] == "sample":
            costs.observe(r["batch"], r["k"], r["device"], r["host"], r["overlapped"], r["tokens"], r["greedy"],
                          r["lap"])
        elif r["kind"] == "probe":  # since session AH (past the modules since AL): older dumps replay without them
            costs.begin_probe(r["batch"], r["k"])
        elif r["kind"] == "interrupt":  # since session AR
            costs.interrupt(r["admitted"])
        elif r["kind"] == "token_price":  # since session AM
            costs.tokens.add_draw(r["drawn"])
        elif r["kind"] == "choice" and (r["batch"] == c if at is None else at(r["batch"])):
            tokens = list(accumulate(r["gains"], initial=r["base"]))
            out.append((r, costs.costs(r["batch"], tokens, greedy=greedy).tolist()))
    return out


def compare(records: list[Record], c: int, what_if: Callable[[StepCosts], None],
            rows: list[tuple[Record, list[float]]] | None = None
            ) -> tuple[int, list[int], dict[str, dict[int, list[float]]], dict[str, list[float]]]:
    """(full choices, the fixed k's, per k the ratios "engine" and "replay" (priced / real mean lap) and "tokens"
    (expected / real), per row the real rate of its pick over the round's best) over the choices whose round ran
    every fixed k. rows: replay()'s at the full batch, where already replayed."""
    real = real_cells(records, c)
    ks = sorted({k for _, k in real})
    rows = replay(records, f"k=auto c={c}", c, what_if) if rows is None else rows
    ratios: dict[str, dict[int, list[float]]] = {name: defaultdict(list) for name in ("engine", "replay", "tokens")}
    picks: dict[str, list[float]] = {"engine": [], "replay": []}
    for choice, replayed in rows:
        laps = {k: real[(choice["round"], k)] for k in ks if (choice["round"], k) in real}
        if len(laps) < len(ks):
            continue
        tokens = list(accumulate(choice["gains"], initial=choice["base"]))
        real_rate = {k: t / lap for k, (lap, t) in laps.items()}
        for k, (lap, made) in laps.items():
            ratios["engine"][k].append(choice["cost"][k] / lap)
            ratios["replay"][k].append(replayed[k] / lap)
            ratios["tokens"][k].append(tokens[k] / made)  # both a step of the full batch
        for label, row in (("engine", choice["cost"]), ("replay", replayed)):
            pick = max(ks, key=lambda k: tokens[k] / row[k])
            picks[label].append(real_rate[pick] / max(real_rate.values()))
    return len(rows), ks, ratios, picks


def picked(rows: list[tuple[Record, list[float]]]) -> dict[str, Counter]:
    """Per row ("engine", "replay"), how often its rate picks each k over the given choices, every k counted (those
    no fixed cell ran among them): where a replayed model moves choices that compare() cannot rate."""
    out: dict[str, Counter] = {"engine": Counter(), "replay": Counter()}
    for choice, replayed in rows:
        tokens = list(accumulate(choice["gains"], initial=choice["base"]))
        for label, row in (("engine", choice["cost"]), ("replay", replayed)):
            out[label][max(range(len(row)), key=lambda k: tokens[k] / row[k])] += 1
    return out


def report(records: list[Record], c: int, name: str, what_if: Callable[[StepCosts], None]) -> None:
    rows = replay(records, f"k=auto c={c}", c, what_if)
    choices, ks, ratios, picks = compare(records, c, what_if, rows)
    print(f"c={c}, {name}: {choices} full choices; per k, priced / real mean lap and expected / real tokens a "
          "step (medians over choices)")
    for k in ks:
        if ratios["engine"][k]:
            e, p, t = (statistics.median(ratios[kind][k]) for kind in ("engine", "replay", "tokens"))
            print(f"  k={k}: lap engine {e:.3f}, replay {p:.3f}; tokens {t:.3f}")
    for label, got in picks.items():
        if got:
            print(f"  {label}'s picks among k={ks}: real rate / best {statistics.mean(got):.3f} (mean), "
                  f"best picked in {sum(g == 1.0 for g in got)} of {len(got)}")
    for label, counts in picked(rows).items():
        print(f"  {label}'s picks among every k: {dict(sorted(counts.items()))}")
    for label, got in rated_picks(rows, step_rates(records, c)).items():
        if got:
            print(f"  {label}'s picks rated by every variant's steps (auto's too): real rate / best "
                  f"{statistics.mean(got):.4f} (mean of {len(got)})")


def below_full(records: list[Record], c: int, what_if: Callable[[StepCosts], None]
               ) -> tuple[int, dict[str, int], dict[str, Counter]]:
    """Auto's choices at batches c/8 to c - 1 (ramps, wave changes, drains), which no fixed cell of the same batch
    measures: (choices, per row "engine" and "replay" its flat rows (k = 1 and 3 priced within 0.1 %: no host price
    of a draft drawn there, session AK), and the k each row's rate picks)."""
    rows = replay(records, f"k=auto c={c}", c, what_if, at=lambda b: c // 8 <= b < c)
    flat = {"engine": 0, "replay": 0}
    for choice, replayed in rows:
        for label, row in (("engine", choice["cost"]), ("replay", replayed)):
            flat[label] += len(row) > 3 and abs(row[3] - row[1]) < 1e-3 * row[1]
    return len(rows), flat, picked(rows)


def report_below_full(records: list[Record], c: int, name: str, what_if: Callable[[StepCosts], None]) -> None:
    n, flat, picks = below_full(records, c, what_if)
    print(f"c={c}, {name}: {n} choices at batches {c // 8}-{c - 1}")
    for label in ("engine", "replay"):
        print(f"  {label}: flat rows {flat[label]}; picks {dict(sorted(picks[label].items()))}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dump", help="a JSON file written by --dump-samples")
    p.add_argument("--variant", default="as-is", choices=sorted(VARIANTS))
    p.add_argument("--below-full", action="store_true", help="auto's choices at batches c/8 to c - 1 instead: flat "
                   "rows and picks, the engine's and the replay's (no fixed cell measures those batches)")
    args = p.parse_args(argv)
    records = cost_samples.load(args.dump)
    for c in sorted({int(r["variant"].split("c=")[1]) for r in records if "auto" in r["variant"]}):
        (report_below_full if args.below_full else report)(records, c, args.variant, VARIANTS[args.variant])
    return 0


if __name__ == "__main__":
    sys.exit(main())
