"""benchmarks/cost_samples.py and replay_costs.py: a GPU run's step-cost samples and choices, recorded and priced
again offline."""

from __future__ import annotations

import base64
import pickle
import sys
from collections import deque
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cost_samples  # noqa: E402
import interleaved  # noqa: E402
import replay_costs  # noqa: E402

from mtpserve.cluster import spec_chooser  # noqa: E402
from mtpserve.cluster.step_costs import StepCosts  # noqa: E402


def _sample(variant: str, round_: int, k: int, lap: float, host: float, tokens: float, batch: int = 4) -> dict:
    return {"kind": "sample", "variant": variant, "round": round_, "t": 0.0, "batch": batch, "k": k, "lap": lap,
            "host": host, "device": lap * 0.8, "tokens": tokens, "overlapped": True, "greedy": True}


def test_a_tiny_interleaved_run_dumps_each_engine_and_restores_the_chooser(tmp_path: Path) -> None:
    path = tmp_path / "s.json.gz"
    assert interleaved.main(["--tiny", "--device", "cpu", "--ks", "1,auto", "--concurrency", "4", "--rounds", "2",
                             "--max-tokens", "24", "--no-results", "--dump-samples", str(path)]) == 0
    assert spec_chooser.choose_k.__name__ == "choose_k"  # the wrapper is gone once written
    records = cost_samples.load(path)
    states = {r["variant"] for r in records if r["kind"] == "state"}
    assert states == {"k=1 c=4", "k=auto c=4"}
    samples = [r for r in records if r["kind"] == "sample"]
    assert {r["round"] for r in samples} == {0, 1}
    assert {r["k"] for r in samples if r["variant"] == "k=1 c=4"} == {1}
    assert all(r["lap"] >= 0 and r["tokens"] >= r["batch"] for r in samples)
    # Every prompt step interrupted the clean runs (StepCosts.interrupt), as an admission.
    assert any(r["kind"] == "interrupt" and r["admitted"] for r in records)
    # Each full choice's host line (level, token price, a price per k, median) is the one a model fed the same
    # samples reads right after pricing the same row.
    lines: list[list] = []

    def recording(costs: StepCosts) -> None:
        priced = costs.costs

        def costs_and_line(batch: int, *args: object, **kwargs: object) -> object:
            row = priced(batch, *args, **kwargs)
            a, slope, prices, median, _ = costs._host_fit(batch, refit=False)
            lines.append([a, slope, list(prices), median])
            return row

        costs.costs = costs_and_line  # type: ignore[method-assign]

    rows = replay_costs.replay(records, "k=auto c=4", 4, recording)
    assert rows and len(lines) == len(rows)
    flat = lambda line: [line[0], line[1], *line[2], line[3]]  # noqa: E731
    for (choice, _), line in zip(rows, lines):
        assert flat(choice["line"]) == pytest.approx(flat(line), rel=1e-9)


def test_the_replay_prices_as_the_model_fed_the_same_samples() -> None:
    start = StepCosts(max_k=2, max_rows=4)
    auto = [_sample("k=auto c=4", 0, 2, 1e-3 * (1 + i % 3 / 10), 0.9e-3, 9.0 + i % 3) for i in range(40)]
    choice = {"kind": "choice", "variant": "k=auto c=4", "round": 0, "t": 0.0, "batch": 4, "gains": [2.0, 1.0],
              "base": 4.0, "floor": 0, "cost": [1e-3, 1.1e-3, 1.2e-3], "current": 2, "chosen": 2}
    state = {"kind": "state", "variant": "k=auto c=4", "costs": base64.b64encode(pickle.dumps(start)).decode()}
    [(seen, row)] = replay_costs.replay([state, *auto, choice], "k=auto c=4", 4, lambda costs: None)
    direct = StepCosts(max_k=2, max_rows=4)
    for r in auto:
        direct.observe(r["batch"], r["k"], r["device"], r["host"], r["overlapped"], r["tokens"], r["greedy"], r["lap"])
    assert seen is choice
    assert row == pytest.approx(direct.costs(4, [4.0, 6.0, 7.0]).tolist())


def test_real_cells_are_the_fixed_variants_full_batch_means_per_round() -> None:
    records = [_sample("k=1 c=4", 0, 1, 1e-3, 0.5e-3, 6.0), _sample("k=1 c=4", 0, 1, 3e-3, 0.5e-3, 8.0),
               _sample("k=1 c=4", 0, 1, 9e-3, 0.5e-3, 2.0, batch=1),  # not the full batch
               _sample("k=auto c=4", 0, 1, 5e-3, 0.5e-3, 4.0), _sample("k=2 c=4", 1, 2, 2e-3, 0.5e-3, 10.0)]
    assert replay_costs.real_cells(records, 4) == {(0, 1): pytest.approx((2e-3, 7.0)), (1, 2): (2e-3, 10.0)}


def test_a_one_engine_cell_phases_dump_replays_its_auto_cells(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    """cell_phases.py runs every variant on one engine: the replay feeds it every cell's samples, in order."""
    import cell_phases

    path = tmp_path / "s.json"
    assert cell_phases.main(["--tiny", "--device", "cpu", "--ks", "2,auto", "--no-results",
                             "--dump-samples", str(path)]) == 0
    records = cost_samples.load(path)
    assert [r["variant"] for r in records if r["kind"] == "state"] == [""]
    assert {r["variant"] for r in records if r["kind"] == "sample"} == {"k=2 c=4", "k=auto c=4"}
    capsys.readouterr()
    assert replay_costs.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("c=4, as-is: ")
    choices = int(out.split("as-is: ")[1].split()[0])  # auto's full choices at the full batch (timing decides how many)
    assert choices == sum(r["kind"] == "choice" and r["variant"] == "k=auto c=4" and r["batch"] == 4 for r in records)
    assert ("k=2: lap engine" in out) == (choices > 0)  # each priced against the k = 2 cell of its round


def test_compare_sets_each_choice_against_its_rounds_fixed_cells() -> None:
    """A choice that priced k = 1 at 1 ms and k = 2 at 3 ms (with 6 and 9 tokens a step) picks k = 1, where the
    round's fixed cells ran k = 1 at 2 ms and k = 2 at 1 ms for the same tokens: half the best rate."""
    start = StepCosts(max_k=2, max_rows=4)
    state = {"kind": "state", "variant": "k=auto c=4", "costs": base64.b64encode(pickle.dumps(start)).decode()}
    choice = {"kind": "choice", "variant": "k=auto c=4", "round": 0, "t": 0.0, "batch": 4, "gains": [2.0, 3.0],
              "base": 4.0, "floor": 0, "cost": [0.5e-3, 1e-3, 3e-3], "current": 2, "chosen": 1}
    fixed = [_sample("k=1 c=4", 0, 1, 2e-3, 1e-3, 6.0), _sample("k=2 c=4", 0, 2, 1e-3, 0.5e-3, 9.0)]
    choices, ks, ratios, picks = replay_costs.compare([state, *fixed, choice], 4, lambda costs: None)
    assert (choices, ks) == (1, [1, 2])
    assert ratios["engine"][1] == [pytest.approx(0.5)] and ratios["engine"][2] == [pytest.approx(3.0)]
    assert ratios["tokens"][1] == [pytest.approx(1.0)] and ratios["tokens"][2] == [pytest.approx(1.0)]
    assert picks["engine"] == [pytest.approx((6 / 2) / (9 / 1))]
    # Among every k the engine's row picks k = 0 (4 tokens in 0.5 ms), which no fixed cell ran, so compare() cannot
    # rate that pick; picked() counts it.
    rows = replay_costs.replay([state, *fixed, choice], "k=auto c=4", 4, lambda costs: None)
    assert replay_costs.picked(rows)["engine"] == {0: 1}


def test_picks_are_rated_by_every_variants_steps_auto_s_own_among_them() -> None:
    """Round 0: fixed k = 2 ran 8 full-batch steps at 9 tokens a ms; auto ran k = 1 for 8 at 6 tokens a ms and k = 0
    for 3 (too few to rate). A choice that picks k = 1 makes 6 / 9 of the best rated rate; one in round 1, which
    rated nothing, is left out."""
    samples = [_sample("k=2 c=4", 0, 2, 1e-3, 0.5e-3, 9.0)] * 8 + [_sample("k=auto c=4", 0, 1, 1e-3, 0.5e-3, 6.0)] * 8
    samples += [_sample("k=auto c=4", 0, 0, 1e-3, 0.5e-3, 8.0)] * 3
    rates = replay_costs.step_rates(samples, 4)
    assert rates == {(0, 2): pytest.approx(9e3), (0, 1): pytest.approx(6e3)}
    choice = {"round": 0, "gains": [2.0, 3.0], "base": 4.0, "cost": [0.5e-3, 1e-3, 3e-3]}  # picks k = 1 of 1, 2
    later = {**choice, "round": 1}
    got = replay_costs.rated_picks([(choice, [1.0, 1.0, 0.1]), (later, [1.0, 1.0, 1.0])], rates)
    assert got == {"engine": [pytest.approx(6 / 9)], "replay": [pytest.approx(1.0)]}


def test_a_model_pickled_before_a_field_was_added_replays_with_the_field_as_it_starts() -> None:
    older = StepCosts(max_k=2, max_rows=4, modules=1)
    del older.__dict__["_draft_draws"], older.__dict__["_probes"]  # as a run before session AG pickled it
    restored = replay_costs.upgraded(pickle.loads(pickle.dumps(older)))
    current = StepCosts(max_k=2, max_rows=4, modules=1)
    for model in (restored, current):  # observe reads the probe in progress, begin_probe starts one
        model.observe(4, 1, 1e-3, 0.9e-3, True, 8.0, True, 1.1e-3)
        model.begin_probe(4, 1)
        model.observe(4, 0, 0.8e-3, 0.8e-3, True, 4.0, True, 0.9e-3)
    assert restored.costs(4, [4.0, 6.0, 7.0]).tolist() == current.costs(4, [4.0, 6.0, 7.0]).tolist()
    assert restored._probes == current._probes and not restored.knows_draft_price(4)


def test_a_recorded_probe_starts_in_the_replay_where_the_engine_started_it() -> None:
    """A probe of k - 1 draws the host's price of a draft from its steps and those at k around it: the replay starts
    it at the recorded step, so its model draws what the engine's drew."""
    start = StepCosts(max_k=2, max_rows=4, modules=2)
    state = {"kind": "state", "variant": "k=auto c=4", "costs": base64.b64encode(pickle.dumps(start)).decode()}
    at_k = [_sample("k=auto c=4", 0, 2, 1e-3, 1.0e-3, 9.0) for _ in range(8)]
    probe = [_sample("k=auto c=4", 0, 1, 1e-3, 0.8e-3, 9.0) for _ in range(8)]
    records = [state, *at_k, {"kind": "probe", "variant": "k=auto c=4", "round": 0, "t": 0.0, "batch": 4, "k": 2},
               *probe, *at_k]
    replayed: list[StepCosts] = []
    replay_costs.replay(records, "k=auto c=4", 4, replayed.append)  # the what-if hook hands over its model
    direct = StepCosts(max_k=2, max_rows=4, modules=2)
    for r in at_k:
        direct.observe(r["batch"], r["k"], r["device"], r["host"], r["overlapped"], r["tokens"], r["greedy"], r["lap"])
    direct.begin_probe(4, 2)
    for r in probe + at_k:
        direct.observe(r["batch"], r["k"], r["device"], r["host"], r["overlapped"], r["tokens"], r["greedy"], r["lap"])
    drawn = direct._draft_draws[direct.bucket(4)]
    assert list(drawn) == [pytest.approx(0.05e-3)]  # (1.0 - 0.8) ms a step of 4 requests, one draft each
    assert list(replayed[0]._draft_draws[direct.bucket(4)]) == list(drawn)


def test_a_recorded_token_price_draw_reaches_the_replay_where_the_engine_drew_it() -> None:
    """Since session AM the host's price of a token is drawn within steps (token_price.py), which the samples do not
    hold: the dump records each draw, and the replayed line takes it as its slope from that point on."""
    start = StepCosts(max_k=2, max_rows=4, modules=2)
    state = {"kind": "state", "variant": "k=auto c=4", "costs": base64.b64encode(pickle.dumps(start)).decode()}
    drawn = {"kind": "token_price", "variant": "k=auto c=4", "round": 0, "t": 0.0, "drawn": 0.7e-6}
    samples = [_sample("k=auto c=4", 0, k, 1e-3, (0.6 + 0.1 * k) * 1e-3, 4.0 + 3 * k) for k in (1, 2) * 8]
    replayed: list[StepCosts] = []
    replay_costs.replay([state, *samples[:8], drawn, *samples[8:]], "k=auto c=4", 4, replayed.append)
    model = replayed[0]
    assert model.tokens.price == 0.7e-6
    model.refit(4)
    assert model.host_slopes[model.bucket(4)] == 0.7e-6


def test_below_full_counts_flat_rows_and_picks_at_the_batches_no_fixed_cell_measures() -> None:
    """A choice at batch 4 of c = 8 whose row priced k = 0-3 alike (no host price of a draft drawn there) picks the
    most drafts it priced alike; one at the full batch, or below c/8, is not counted."""
    start = StepCosts(max_k=4, max_rows=8)
    state = {"kind": "state", "variant": "k=auto c=8", "costs": base64.b64encode(pickle.dumps(start)).decode()}

    def choice(batch: int, cost: list[float]) -> dict:
        return {"kind": "choice", "variant": "k=auto c=8", "round": 0, "t": 0.0, "batch": batch,
                "gains": [1.0, 0.8, 0.6, 0.4], "base": float(batch), "floor": 0, "cost": cost, "current": 4,
                "chosen": 4}

    sloped = [1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3]
    records = [state, *[_sample("k=auto c=8", 0, 4, 1e-3, 1e-3, 12.0, batch=4) for _ in range(8)],
               choice(4, [1e-3] * 4 + [1.1e-3]), choice(6, sloped), choice(8, [1e-3] * 5), choice(0, [1e-3] * 5)]
    n, flat, picks = replay_costs.below_full(records, 8, lambda costs: None)
    assert n == 2 and flat["engine"] == 1
    assert picks["engine"] == {3: 1, 0: 1}  # the flat row picks k = 3 (k = 4 dearer); the sloped one none
    # Replayed, the device's prior prices each draft (not flat), and each choice is priced at its own batch's tokens:
    # the same row picks k = 3 for batch 4's expected tokens and k = 2 for batch 6's.
    assert flat["replay"] == 0 and picks["replay"] == {3: 1, 2: 1}


def test_a_model_pickled_with_three_recursion_draws_replays_with_five() -> None:
    older = StepCosts(max_k=4, max_rows=8, modules=3)
    b = older.bucket(8)
    older._recursion_draws = [deque(d, maxlen=3) for d in older._recursion_draws]  # as before session AM
    older._recursion_draws[b].extend([1e-6, 2e-6])
    restored = replay_costs.upgraded(pickle.loads(pickle.dumps(older)))
    assert restored._recursion_draws[b].maxlen == StepCosts.RECURSION_DRAWS == 5
    assert list(restored._recursion_draws[b]) == [1e-6, 2e-6]


def test_the_token_price_what_ifs_override_what_the_warm_up_drew() -> None:
    costs = StepCosts(max_k=2, max_rows=4, modules=2)
    costs.tokens.add_draw(3e-6)  # drawn in the warm-up, before the model was pickled
    replay_costs.VARIANTS["token-0.3"](costs)
    costs.tokens.add_draw(5e-6)  # a recorded draw, ignored in these what-ifs
    assert costs.tokens.price == pytest.approx(0.3e-6)
    window = StepCosts(max_k=2, max_rows=4, modules=2)
    window.tokens.add_draw(3e-6)
    window.host_slopes = [3e-6] * len(window.host_slopes)  # the warm-up's fits took it
    replay_costs.window_tokens(window)
    window.tokens.add_draw(0.7e-6)
    assert window.tokens.price is None and set(window.host_slopes) == {0.0}


@pytest.mark.parametrize("variant", sorted(replay_costs.VARIANTS))
def test_every_what_if_variant_prices_a_recorded_choice(variant: str) -> None:
    """Each variant patches the cost model it is given; one that no longer fits StepCosts' signatures fails here
    rather than on a GPU run's dump (no-spread and draft-* broke when _host_fit took the recursion's price)."""
    start = StepCosts(max_k=2, max_rows=4)
    state = {"kind": "state", "variant": "k=auto c=4", "costs": base64.b64encode(pickle.dumps(start)).decode()}
    auto = [_sample("k=auto c=4", 0, 1 + i % 2, 1e-3 * (1 + i % 3 / 10), 0.9e-3, 6.0 + i % 3) for i in range(40)]
    choice = {"kind": "choice", "variant": "k=auto c=4", "round": 0, "t": 0.0, "batch": 4, "gains": [2.0, 1.0],
              "base": 4.0, "floor": 0, "cost": [1e-3, 1.1e-3, 1.2e-3], "current": 2, "chosen": 2}
    [(seen, row)] = replay_costs.replay([state, *auto, choice], "k=auto c=4", 4, replay_costs.VARIANTS[variant])
    assert seen is choice and len(row) == 3 and all(cost > 0 for cost in row)
