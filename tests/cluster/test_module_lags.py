"""Each MTP module's lag is tracked from where that module stopped (docs/design.md §9).

Requests decoding at k = 2 leave module 3 (of 3) behind; a probe to k = 1 later leaves module 2 behind from
there. A return to k = 2 must rewind only module 2's short lag, and a long lag of module 3 must not keep the
request from rising to 2: with one lag point per request both were measured from the first fall, so a probe's
return either rewound the whole lag or, past MAX_CATCH_UP, left the request at k = 1 for good.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.scheduler import Scheduler
from tests.cluster.test_adaptive_speculation import force_k
from tests.conftest import prompts_of

PROMPTS = prompts_of(64, [5, 9, 14], seed=8)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
MODULE_OFFSETS = 2  # module m commits m - 1 positions behind module 1: the count's bound over the workers' rewind


def _run(model: Path, monkeypatch: pytest.MonkeyPatch, schedule: list[int], **engine: object
         ) -> tuple[list[tuple[str, int, int]], list[tuple[int, int, int]]]:
    """Greedy outputs checked against k = 0 under a forced schedule of k. Returns each catch-up as (request,
    spec, positions the workers rewound) and each step with catch-ups as (positions rewound, requests, the
    plan's count)."""
    expected = [o.token_ids for o in LLM(str(model), num_speculative_tokens=0).generate(PROMPTS, PARAMS)]
    force_k(monkeypatch, schedule)
    llm = LLM(str(model), block_size=4, **engine)
    runner, caught, counted = llm.engine.executor.runner, [], []
    catch_up = runner._catch_up

    def recorded(reqs, plan):
        rewound = catch_up(reqs, plan)
        now = [(rid, spec, after - before) for rid, spec, before, after
               in zip(plan.req_ids, plan.num_spec, plan.num_tokens, rewound.num_tokens) if after > before]
        if now:
            caught.extend(now)
            counted.append((sum(r for _, _, r in now), len(now), plan.catch_up_tokens))
        return rewound

    runner._catch_up = recorded
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    return caught, counted


def _assert_counted(counted: list[tuple[int, int, int]]) -> None:
    """The plan counts the workers' rewinds, bounded by the modules' offsets: the step's budget holds them."""
    assert all(rewound <= count <= rewound + n * MODULE_OFFSETS for rewound, n, count in counted), counted


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("max_catch_up", "k_after", "rises_to"), [
    (256, 2, 2),  # a probe's return catches module 2 up over the probe's positions only
    (8, 2, 2),  # module 3's long lag does not stop it
    (8, 3, 2),  # a rise to 3 would rewind past MAX_CATCH_UP (module 3 lags since the prompt's end): it takes 2
    (256, 3, 3),  # within MAX_CATCH_UP the rise to 3 rewinds over module 3's lag, counted as such
])
def test_a_probe_return_rewinds_only_the_modules_the_probe_left_behind(
        partly_trained: Path, monkeypatch: pytest.MonkeyPatch, max_catch_up: int, k_after: int, rises_to: int,
        overlap: bool) -> None:
    """Also where the falls are planned while a step is in flight (async): the rises run synchronously."""
    monkeypatch.setattr(Scheduler, "MAX_CATCH_UP", max_catch_up)
    # Prefill and 9 decode steps at k = 2 (module 3's lag grows past 8), a 3-step probe at k = 1, then k_after.
    caught, counted = _run(partly_trained, monkeypatch, [2] * 10 + [1] * 3 + [k_after] * 60,
                           async_scheduling=overlap)
    assert sorted(Counter(rid for rid, _, _ in caught).values()) == [1] * len(PROMPTS), caught  # each once
    assert all(spec == rises_to for _, spec, _ in caught), caught
    _assert_counted(counted)
    # Module 2 lags over the probe's three steps (at most two positions each), module 3 over ten steps or more.
    assert all((rewound > 10) == (rises_to == 3) for _, _, rewound in caught), caught


def test_falls_in_several_steps_rewind_each_rise_over_the_modules_it_reaches(
        partly_trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """3 -> 2 -> 1, then 2 (module 2's lag only), then 3 (module 3's, from the first fall)."""
    caught, counted = _run(partly_trained, monkeypatch, [3] * 3 + [2] * 4 + [1] * 3 + [2] * 4 + [3] * 60,
                           async_scheduling=False)
    per_request = {rid: [spec for r, spec, _ in caught if r == rid] for rid, _, _ in caught}
    assert len(per_request) == len(PROMPTS) and all(specs == [2, 3] for specs in per_request.values()), caught
    _assert_counted(counted)


def test_an_owed_catch_up_reaches_only_the_modules_it_is_owed(partly_trained: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A rise to 2 that a step's budget cannot hold is owed and caught up later, however far module 2 lags by
    then; that debt does not let a rise to 3 past MAX_CATCH_UP catch module 3 up."""
    monkeypatch.setattr(Scheduler, "MAX_CATCH_UP", 8)
    caught, counted = _run(partly_trained, monkeypatch, [2] * 10 + [1] * 3 + [3] * 60, async_scheduling=False,
                           max_num_batched_tokens=16)
    assert len(counted) > 1, counted  # not all in one step: some were owed
    assert sorted(Counter(rid for rid, _, _ in caught).values()) == [1] * len(PROMPTS), caught
    assert all(spec == 2 for _, spec, _ in caught), caught
    _assert_counted(counted)
