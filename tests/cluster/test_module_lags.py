"""Each MTP module's lag is tracked from where that module stopped (docs/design.md §9).

A batch of newcomers admitted at k = 2 leaves module 3 (of 3) behind from its first position; a probe to k = 1 later
leaves module 2 behind from there. A return to k = 2 must rewind only module 2's short lag, and a long lag of
module 3 must not keep the request from rising to 2: with one lag point per request, both were measured from the
first fall, so a probe return either rewound the whole request or, past MAX_CATCH_UP, left it at k = 1 for good.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.scheduler import Scheduler
from tests.cluster.test_adaptive_speculation import force_k
from tests.conftest import prompts_of

PROMPTS = prompts_of(64, [5, 9, 14], seed=8)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
MODULE_OFFSETS = 2  # module m commits m - 1 positions behind module 1: the count's bound over the workers' rewind


@pytest.mark.parametrize(("max_catch_up", "k_after", "rises_to"), [
    (256, 2, 2),  # a probe's return catches module 2 up over the probe's positions only
    (8, 2, 2),  # module 3's long lag does not stop it
    (8, 3, 2),  # a rise to 3 would rewind past MAX_CATCH_UP (module 3 lags from the prompt): the request takes 2
    (256, 3, 3),  # within MAX_CATCH_UP the rise to 3 rewinds from the prompt, counted as such
])
def test_a_probe_return_rewinds_only_the_modules_the_probe_left_behind(
        partly_trained: Path, monkeypatch: pytest.MonkeyPatch, max_catch_up: int, k_after: int, rises_to: int) -> None:
    expected = [o.token_ids for o in LLM(str(partly_trained), num_speculative_tokens=0).generate(PROMPTS, PARAMS)]
    monkeypatch.setattr(Scheduler, "MAX_CATCH_UP", max_catch_up)
    # Prefill and 9 decode steps at k = 2 (module 3's lag grows past 8), a 3-step probe at k = 1, then k_after.
    force_k(monkeypatch, [2] * 10 + [1] * 3 + [k_after] * 60)
    llm = LLM(str(partly_trained), block_size=4, async_scheduling=False)
    runner, caught, counted = llm.engine.executor.runner, [], []  # (spec, positions rewound); (rewound, counted)
    catch_up = runner._catch_up

    def recorded(reqs, plan):
        rewound = catch_up(reqs, plan)
        now = [(spec, after - before) for spec, before, after in zip(plan.num_spec, plan.num_tokens, rewound.num_tokens)
               if after > before]
        if now:
            caught.extend(now)
            counted.append((sum(r for _, r in now), len(now), plan.catch_up_tokens))
        return rewound

    runner._catch_up = recorded
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert len(caught) == len(PROMPTS), caught  # each request caught up once
    assert all(spec == rises_to for spec, _ in caught), caught
    # The plan counts the workers' rewind, bounded by the modules' offsets (the step's budget holds what it counts).
    assert all(rewound <= count <= rewound + n * MODULE_OFFSETS for rewound, n, count in counted), counted
    # Module 2 lags over the probe's three steps (at most two positions each); module 3 from the prompt.
    assert all((rewound > 10) == (rises_to == 3) for _, rewound in caught), caught
