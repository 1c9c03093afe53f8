"""prefill_hold_steps: while requests decode, arrivals wait a few steps to be prefilled together.

The hold changes when a request joins, never what it generates; it never delays a request when
nothing decodes, and it lets arrivals in at once when there are enough of them.
"""

from __future__ import annotations

from pathlib import Path

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.sampling_params import SamplingParams
from tests.conftest import prompts_of

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, num_speculative_tokens=2)


def _engine(ckpt: Path, hold: int, max_num_seqs: int = 16) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", num_speculative_tokens=2,
                                  max_num_seqs=max_num_seqs, prefill_hold_steps=hold))


def _decoding(engine: LLMEngine, n: int) -> None:
    """n requests in flight, every one past its prefill."""
    for i, p in enumerate(prompts_of(64, [5 + i for i in range(n)], seed=3)):
        engine.add_request(f"run{i}", p, GREEDY)
    while engine.scheduler.waiting or any(r.num_computed < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()


def _waits(engine: LLMEngine, request_id: str) -> int:
    """Steps taken until `request_id` left the waiting queue."""
    steps = 0
    while any(r.request_id == request_id for r in engine.scheduler.waiting):
        engine.step()
        steps += 1
    return steps


def test_an_arrival_waits_the_hold_while_others_decode(trained_ckpt: Path) -> None:
    engine = _engine(trained_ckpt, hold=3)
    _decoding(engine, 8)
    engine.add_request("late", prompts_of(64, [7], seed=4)[0], GREEDY)
    assert _waits(engine, "late") == 3


def test_no_hold_admits_at_the_next_step(trained_ckpt: Path) -> None:
    engine = _engine(trained_ckpt, hold=0)
    _decoding(engine, 8)
    engine.add_request("late", prompts_of(64, [7], seed=4)[0], GREEDY)
    assert _waits(engine, "late") == 1


def test_nothing_decoding_means_no_hold(trained_ckpt: Path) -> None:
    engine = _engine(trained_ckpt, hold=5)
    engine.add_request("first", prompts_of(64, [7], seed=4)[0], GREEDY)
    assert _waits(engine, "first") == 1


def test_a_quarter_of_the_batch_waiting_joins_at_once(trained_ckpt: Path) -> None:
    engine = _engine(trained_ckpt, hold=5)
    _decoding(engine, 8)
    for i, p in enumerate(prompts_of(64, [6, 8], seed=5)):  # 2 = 8 // 4 arrivals
        engine.add_request(f"late{i}", p, GREEDY)
    assert _waits(engine, "late1") == 1


def test_an_arrival_for_the_last_free_slot_of_a_full_batch_waits_the_hold(trained_ckpt: Path) -> None:
    """At high load slots free up a few a step: filled at once, each would cost a step with prompts of its
    own; held, they are filled together every `hold` steps."""
    engine = _engine(trained_ckpt, hold=3, max_num_seqs=9)
    _decoding(engine, 8)
    engine.add_request("late", prompts_of(64, [7], seed=4)[0], GREEDY)  # would fill every free slot
    assert _waits(engine, "late") == 3


def test_the_hold_changes_no_output(trained_ckpt: Path) -> None:
    def run(hold: int) -> dict[str, list[int]]:
        engine, done = _engine(trained_ckpt, hold, max_num_seqs=6), {}
        prompts = prompts_of(64, [4 + 3 * i for i in range(10)], seed=6)
        for i, p in enumerate(prompts[:6]):
            engine.add_request(str(i), p, GREEDY)
        queued = 6
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
                    if queued < len(prompts):  # a closed loop: each finish lets the next request in
                        engine.add_request(str(queued), prompts[queued], GREEDY)
                        queued += 1
        return done

    held = run(4)
    assert len(held) == 10 and all(len(t) == 24 for t in held.values())
    assert held == run(0)
