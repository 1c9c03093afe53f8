"""benchmarks/host_growth.py: waves of the default model's engine on the CPU, the detokenizers taken in turn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host_growth  # noqa: E402


def test_waves_alternate_the_detokenizers_and_profile_the_first_of_each() -> None:
    args = argparse.Namespace(device="cpu", concurrency=2, ks=[2], max_tokens=24, prompt_len=8, waves=4,
                              detok=["table", "window"], window=2, gc="on", top=3,
                              engine_per_k=False)
    waves = host_growth.run(args)
    assert [w.detok for w in waves] == ["table", "window", "table", "window"]
    assert [bool(w.profiles) for w in waves] == [True, True, False, False]
    assert all(w.tokens == 2 * 24 and w.wall > 0 and len(w.laps) == len(w.gcs) for w in waves)
    titles = [t.title for t in host_growth.tables(args, waves)]
    assert any("by k and detokenizer" in t for t in titles) and sum("own time per step" in t for t in titles) == 3


def test_waves_alternate_a_fixed_k_engine_and_an_auto_one() -> None:
    args = argparse.Namespace(device="cpu", concurrency=2, ks=[2, "auto"], max_tokens=16, prompt_len=8, waves=2,
                              detok=["table"], window=2, gc="on", top=3, engine_per_k=True)
    waves = host_growth.run(args)
    assert [w.k for w in waves] == [2, "auto"] and all(w.profiles and w.tokens == 2 * 16 for w in waves)
    compared = host_growth.tables(args, waves)[-1]
    assert "k = auto, table against k = 2, table" in compared.title and compared.rows


def test_one_engine_serves_every_k_unless_each_gets_its_own() -> None:
    args = argparse.Namespace(device="cpu", concurrency=2, ks=[2, "auto"], engine_per_k=False)
    shared = host_growth.engines(args)
    assert shared[2] is shared["auto"] and shared[2].resolved.config.num_speculative_tokens == "auto"
    args.engine_per_k = True
    own = host_growth.engines(args)
    assert own[2] is not own["auto"] and own[2].resolved.config.num_speculative_tokens == 2
