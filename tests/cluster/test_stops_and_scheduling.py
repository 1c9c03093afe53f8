"""Stop conditions, streaming text, budgets and request validation in the engine (CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.engine import LLMEngine
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.errors import InvalidRequestError
from tests.checkpoints import make_hf_checkpoint
from tests.conftest import prompts_of

PROMPT = [3, 9, 4, 17, 22]


@pytest.fixture(scope="module")
def worded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model with a word-level tokenizer ("w3" .. "w96") and 2 MTP modules; eos is token 2."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("worded"), vocab_size=97, num_mtp=2, tokenizer=True, seed=3)
    return path


def _run(path: Path, params: SamplingParams, k: int = 2, prompt: list[int] = PROMPT):
    return LLM(str(path), num_speculative_tokens=k).generate([prompt], params)[0]


def test_stop_token_ids_end_the_request_with_the_token_kept(worded: Path) -> None:
    free = _run(worded, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = _run(worded, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]))
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_eos_from_generation_config_stops_unless_ignored(worded: Path, tmp_path: Path) -> None:
    free = _run(worded, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    eos = free.token_ids[3]
    shutil.copytree(worded, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), num_speculative_tokens=2))
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=30, temperature=0.0))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    first = free.token_ids.index(eos)
    assert done["a"].token_ids == free.token_ids[: first + 1] and done["a"].finish_reason == "stop"
    assert done["b"].token_ids == free.token_ids and done["b"].finish_reason == "length"


def test_stop_strings_never_appear_in_text_or_stream(worded: Path) -> None:
    free = _run(worded, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    words = free.text.split()
    stop = " ".join(words[6:8])  # spans two tokens, so it completes mid-window
    engine = LLMEngine(EngineConfig(model=str(worded), num_speculative_tokens=3))
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_text
            final = out if out.finished else final
    assert final.finish_reason == "stop"
    assert final.text == free.text[: free.text.index(stop)] == streamed
    assert stop not in final.text


def test_length_and_context_limits(worded: Path) -> None:
    out = _run(worded, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), k=3)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt"),
    ([5, 97], SamplingParams(), "prompt_token_ids"),
    ([5] * 512, SamplingParams(), "prompt"),
    ([5] * 500, SamplingParams(max_tokens=20), "max_tokens"),
    ("w5 w6", SamplingParams(num_speculative_tokens=2), None),
])
def test_invalid_requests_name_the_field(worded: Path, prompt, params: SamplingParams, field: str | None) -> None:
    engine = LLMEngine(EngineConfig(model=str(worded)))
    if field is None:
        engine.add_request("ok", prompt, params)  # text prompts go through the tokenizer
        assert engine.has_unfinished_requests()
        return
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("x", prompt, params)
    assert err.value.field == field and field in str(err.value)
    assert not engine.has_unfinished_requests()


def test_duplicate_running_request_id_is_rejected(worded: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(worded)))
    engine.add_request("same", PROMPT, SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("same", PROMPT, SamplingParams(max_tokens=3))


def test_token_budget_and_sequence_cap_hold_every_step(worded: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(worded), num_speculative_tokens=2, max_num_batched_tokens=10,
                                    max_num_seqs=3, block_size=4))
    for i, p in enumerate(prompts_of(97, [23, 5, 14, 2, 9], seed=2)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        assert plan.num_scheduled_tokens <= 10
        assert len(engine.scheduler.running) <= 3
        result = engine.executor.execute(plan)
        engine._postprocess(plan, result, engine.last_stats)
    assert engine.blocks.all_free


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_requests_kv_groups_gain_blocks_together(worded: Path, k: int) -> None:
    """At k = 3 over 2 modules the second module's group writes a position past the target's end; every group is
    grown as far as it, so the groups cross block boundaries in the same step: one allocation (and one block-table
    diff per group on the workers) per block, not one per group boundary (k = 3 failed before). A group the chain
    does not reach (the second module's at k = 1) gets no block."""
    engine = LLMEngine(EngineConfig(model=str(worded), num_speculative_tokens=k, block_size=4))
    for i, p in enumerate(prompts_of(97, [7, 13, 4], seed=5)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    used, steps = min(k, 2) + 1, 0
    while engine.has_unfinished_requests():
        steps += 1
        engine.step()
        lengths = [[len(t) for t in tables] for tables in engine.blocks.tables.values()]
        assert all(len(set(per_group[:used])) == 1 and not any(per_group[used:]) for per_group in lengths), lengths
    assert steps > 10 and engine.blocks.all_free


def test_a_model_without_mtp_modules_serves_without_speculation(tmp_path: Path) -> None:
    """No MTP module: no group but the target's, and a step's blocks reach the target's end (a review found the
    furthest group's reach taken over no groups at all)."""
    path = make_hf_checkpoint(tmp_path / "plain", vocab_size=97, num_mtp=0, seed=4)
    out = LLM(str(path), num_speculative_tokens=0, block_size=4).generate(
        prompts_of(97, [6, 11], seed=1), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [9, 9]


def test_logprobs_are_the_models_and_do_not_depend_on_speculation(worded: Path) -> None:
    import torch

    from tests.checkpoints import load_hf_model

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    plain, spec = _run(worded, params, k=0), _run(worded, params, k=3)
    assert plain.token_ids == spec.token_ids and len(plain.logprobs) == len(spec.logprobs) == 10
    hf = load_hf_model(worded)
    with torch.no_grad():
        logp = hf(torch.tensor([PROMPT + plain.token_ids])).logits[0, len(PROMPT) - 1 : -1].log_softmax(-1)
    for j, (token, a, b) in enumerate(zip(plain.token_ids, plain.logprobs, spec.logprobs)):
        top = logp[j].topk(3)
        assert set(a) == set(b) == set(top.indices.tolist()) | {token}
        for t, v in a.items():
            assert abs(v - logp[j, t].item()) < 1e-4 and abs(b[t] - v) < 1e-4
