"""The speculative engine end to end on CPU (docs/design.md §3-§5): equivalence, replay, seeds, accounting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtpserve import LLM, SamplingParams
from tests.checkpoints import load_hf_model
from tests.conftest import prompts_of
from tests.reference import DEEPSEEK, Reference

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 2, 3, 5, 7, 9, 12, 15, 17, 20, 23, 26, 30, 33, 38, 41, 47, 52, 60, 64, 4, 11]


def _generate(path: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
              **engine_args) -> tuple[list, LLM]:
    llm = LLM(str(path), **engine_args)
    return llm.generate(prompts, params), llm


def test_greedy_outputs_identical_for_every_k_under_chunking_and_preemption(partly_trained: Path) -> None:
    prompts = prompts_of(64, LENGTHS, seed=3)
    hf = load_hf_model(partly_trained)
    expected = [
        hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=24,
                    do_sample=False, eos_token_id=None, pad_token_id=None)[0, len(p):].tolist()
        for p in prompts
    ]
    for k in range(5):
        # 60 blocks of 4 cannot hold 22 requests of up to 88 positions: the newest get preempted.
        outs, llm = _generate(partly_trained, prompts, GREEDY, num_speculative_tokens=k, block_size=4,
                              num_kv_blocks=60, max_num_batched_tokens=32)
        assert [o.token_ids for o in outs] == expected, f"k={k}"
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.blocks.all_free
        if k > 0:
            accepted = [a for o in outs for a in o.accepted_per_step]
            assert 0 < sum(accepted) < k * len(accepted), "drafts must be both accepted and rejected"


def _replay(ref: Reference, tokens: list[int], prompt_len: int, k: int, max_tokens: int, mode: str) -> list[int]:
    """Accepted counts per verification step, derived offline from teacher-forced predictions."""
    seq = torch.tensor(tokens)
    pre, post, _ = ref.target(seq)
    depth = ref.mtp(seq, 3, DEEPSEEK) if mode == "depth" else None
    counts, n = [], prompt_len + 1  # the prefill samples t_P; drafts come from position p = n - 2
    while n - prompt_len < max_tokens:
        drafts_verified = min(k, max_tokens - (n - prompt_len) - 1)
        accepted = 0
        while accepted < drafts_verified and _predict(ref, seq, post, depth, n - 2, accepted, mode) == tokens[n + accepted]:
            accepted += 1
        if drafts_verified > 0:  # the last token of a request is sampled with no drafts to verify
            counts.append(accepted)
        n += accepted + 1
    return counts


def _predict(ref: Reference, seq: torch.Tensor, post: torch.Tensor, depth: list | None, p: int, j: int, mode: str) -> int:
    """Greedy draft j from position p, given that drafts 0..j-1 equal the true tokens."""
    if mode == "depth":
        return int(depth[j][p].argmax())
    # Recursive: module 0 at p (teacher forced), then at p+1.. on its own output and the true tokens.
    hidden, out = post[: p + 1], None
    for step in range(j + 1):
        logits, handed = ref.module(0, seq[1 : p + 2 + step], hidden, DEEPSEEK)
        hidden = torch.cat((post[: p + 1], handed[p : p + 1 + step]))
        out = logits[-1]
    return int(out.argmax())


@pytest.mark.parametrize("mode", ["depth", "recursive"])
def test_accepted_counts_replay_teacher_forced_predictions(partly_trained: Path, mode: str) -> None:
    prompts = prompts_of(64, [5, 13, 29, 2], seed=4)
    outs, _ = _generate(partly_trained, prompts, GREEDY, num_speculative_tokens=3, mtp_chain=mode, block_size=4)
    ref = Reference(partly_trained)
    replayed = []
    for prompt, out in zip(prompts, outs):
        expected = _replay(ref, prompt + out.token_ids, len(prompt), 3, GREEDY.max_tokens, mode)
        assert out.accepted_per_step == expected
        replayed += expected
    assert len(set(replayed)) > 2, "the replay must cover several acceptance patterns"


def test_first_drafts_come_out_of_the_prefill(trained_ckpt: Path) -> None:
    """Every step after the prompt verifies drafts: no plain decode step, no extra drafting step."""
    outs, _ = _generate(trained_ckpt, prompts_of(64, [4, 9, 16]), GREEDY, num_speculative_tokens=3)
    for out in outs:
        assert len(out.token_ids) == 1 + sum(a + 1 for a in out.accepted_per_step)
        assert sum(out.accepted_per_step) > len(out.accepted_per_step)  # a trained model accepts often


def test_per_request_speculation_override(trained_ckpt: Path) -> None:
    prompts = prompts_of(64, [6, 10, 14, 18])
    ks = [0, 3, 1, 0]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=k) for k in ks]
    outs, _ = _generate(trained_ckpt, prompts, params, num_speculative_tokens=2)
    plain, _ = _generate(trained_ckpt, prompts, GREEDY, num_speculative_tokens=0)
    assert [o.token_ids[:20] for o in outs] == [o.token_ids[:20] for o in plain]
    for out, k in zip(outs, ks):
        assert (len(out.accepted_per_step) > 0) == (k > 0)
        assert all(a <= k for a in out.accepted_per_step)


def test_seeded_sampling_ignores_batch_companions_and_chunk_budget(trained_ckpt: Path) -> None:
    prompt = prompts_of(64, [11], seed=7)[0]
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone, _ = _generate(trained_ckpt, [prompt], seeded, num_speculative_tokens=3)
    others = prompts_of(64, [3, 25, 8, 40], seed=8)
    mixed = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 4
    crowd, _ = _generate(trained_ckpt, others[:2] + [prompt] + others[2:], mixed[:2] + [seeded] + mixed[2:],
                         num_speculative_tokens=3, max_num_batched_tokens=7, block_size=4)
    again, _ = _generate(trained_ckpt, [prompt], seeded, num_speculative_tokens=3)
    assert crowd[2].token_ids == alone[0].token_ids == again[0].token_ids
    other_seed, _ = _generate(trained_ckpt, [prompt], SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True), num_speculative_tokens=3)
    assert other_seed[0].token_ids != alone[0].token_ids


def test_every_block_of_every_group_is_free_after_finish_and_abort(trained_ckpt: Path) -> None:
    llm = LLM(str(trained_ckpt), num_speculative_tokens=4, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    engine = llm.engine
    prompts = prompts_of(64, [5, 30, 12, 44, 7, 21], seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True))
    finished = {}
    for step in range(200):
        if step == 3:
            engine.abort_request("r1")  # mid-prefill or mid-decode, whichever it is in
        if step == 6:
            engine.abort_request("r4")
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert all(u <= 1.0 for u in engine.blocks.usage())
        if not engine.has_unfinished_requests():
            break
    assert finished["r1"].finish_reason == finished["r4"].finish_reason == "abort"
    assert all(finished[f"r{i}"].finish_reason == "length" for i in (0, 2, 3, 5))
    assert engine.blocks.all_free
    assert engine.blocks.usage() == [0.0] * 4
    engine.step()  # workers hear of the last frees with the next plan
    assert not engine.executor.runner.requests


def test_seeded_outputs_unchanged_by_preemption(partly_trained: Path) -> None:
    """A preempted request resumes with its newest token held back and re-emitted by the recomputing
    prefill, so its drafts, and with them its seeded samples, equal those of a run never preempted."""
    prompts = prompts_of(64, LENGTHS, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=300 + i, ignore_eos=True,
                             num_speculative_tokens=3, repetition_penalty=1.2 if i % 2 else 1.0)
              for i in range(len(prompts))]
    # The token budget never binds, so every step verifies the same drafts in both runs (a seeded sample
    # depends on how many drafts are verified); only the KV pool differs.
    roomy, _ = _generate(partly_trained, prompts, params, block_size=4, num_kv_blocks=1000)
    tight, llm = _generate(partly_trained, prompts, params, block_size=4, num_kv_blocks=60)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert llm.engine.blocks.all_free
