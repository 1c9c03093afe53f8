"""benchmarks/host_only.py: the engine over an executor that answers at once, for the host's share of auto."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host_only  # noqa: E402
import workloads  # noqa: E402


def _run(k: int | str, acceptance: list[float], lengths: list[int]) -> tuple[workloads.Run, LLMEngine]:
    engine = LLMEngine(EngineConfig(device="cpu", max_num_seqs=2, num_kv_blocks=64),
                       host_only.InstantExecutor(acceptance))
    prompts = np.random.default_rng(0).integers(*host_only.TOKENS, (len(lengths), 9)).tolist()
    jobs = [workloads.Job(p, SamplingParams(max_tokens=n, ignore_eos=True, num_speculative_tokens=k))
            for p, n in zip(prompts, lengths)]
    return workloads.drive(engine, jobs, 2, "h"), engine


def test_every_request_gets_its_tokens_and_drafts_are_accepted_as_told() -> None:
    run, _ = _run(3, [1.0], [40, 41, 23])
    assert run.num_tokens == 40 + 41 + 23
    assert run.spec.acceptance_length > 3.5  # all 3 drafts accepted, but near max_tokens
    never, _ = _run(3, [0.0], [20, 20])
    assert never.spec.acceptance_length == 1.0 and never.num_tokens == 40


def test_pinned_auto_runs_the_fixed_k_after_choosing(monkeypatch: pytest.MonkeyPatch) -> None:
    free, engine = _run("auto", [1.0], [64, 64])
    assert free.spec.acceptance_length > 4.0  # every draft accepted: the chooser goes to k = 4
    monkeypatch.setattr(AdaptiveSpec, "choose", AdaptiveSpec.choose)  # restored after the test
    host_only.pin_auto(2)
    pinned, engine = _run("auto", [1.0], [64, 64])
    assert 2.5 < pinned.spec.acceptance_length <= 3.0
    assert engine.adaptive.chosen.sum() > 0  # the chooser still ran its choices
