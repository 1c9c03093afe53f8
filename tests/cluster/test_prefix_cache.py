"""Prefix caching in every KV group (mtpserve/cluster/block_manager.py, prefix_cache.py) end to end on CPU.

Caching must change nothing but the work done: outputs (greedy and seeded), acceptance patterns and the
teacher-forced replay are those of the engine with caching off, for prefixes of every length relative to
the block size (so also those ending m tokens before a block boundary, where module m's stricter reuse
rule gives one block fewer than the target's), under chunked prefill, preemption and aborts; blocks are
never handed out while in use, and none leak.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.cluster.block_manager import BlockPool, KVBlockManager
from mtpserve.cluster.prefix_cache import extend_hashes
from mtpserve.cluster.spec_chooser import AdaptiveSpec
from mtpserve.cluster.serve import add_serve_arguments, config_from_args, load_config
from tests.cluster.test_speculative_engine import _replay
from tests.conftest import prompts_of
from tests.reference import Reference
from tests.workers.test_mtp_kv_invariant import _assert_pools_match, _teacher_forced_keys

BLOCK = 4
NUM_GROUPS = 4  # the target and 3 MTP modules


def _shared_prefix_prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    """A 30-token base prompt, then prompts sharing its first L tokens for L = 1..17 (every residue mod
    the block size, twice) and 29, each with a suffix of its own; plus an exact repeat of the base."""
    base = prompts_of(64, [30], seed=seed)[0]
    suffixes = prompts_of(64, [2 + (length % 5) for length in range(1, 18)] + [3], seed=seed + 1)
    lengths = list(range(1, 18)) + [29]
    return base, [base[:length] + suffix for length, suffix in zip(lengths, suffixes)] + [list(base)]


def _params(i: int, sampled: bool) -> SamplingParams:
    """Greedy or seeded, and every per-request k from 0 to 3."""
    k = i % 4
    if sampled:
        return SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=300 + i, ignore_eos=True,
                              num_speculative_tokens=k)
    return SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)


def _run(path: Path, waves: list[list[tuple[list[int], SamplingParams]]], abort_at: dict[str, int] | None = None,
         **engine_args) -> tuple[dict, LLM, list[int]]:
    """Run the waves one after another (a wave's cached blocks serve the next); after every step the block
    reference counts must match the block tables. Returns outputs by id, the LLM and hits per group."""
    llm = LLM(str(path), **engine_args)
    engine, done, hits = llm.engine, {}, [0] * len(llm.engine.blocks.pools)
    for w, wave in enumerate(waves):
        for i, (prompt, params) in enumerate(wave):
            engine.add_request(f"{w}-{i}", prompt, params)
        for step in range(10_000):
            for req_id, at in (abort_at or {}).items():
                if at == step and req_id.startswith(f"{w}-"):
                    engine.abort_request(req_id)
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            hits = [a + b for a, b in zip(hits, engine.last_stats.prefix_cache_hits or [0] * len(hits))]
            assert engine.blocks.audit() == []
            if not engine.has_unfinished_requests():
                break
    assert engine.blocks.all_free and engine.blocks.audit() == []
    return done, llm, hits


def _waves(seed: int, sampled: bool) -> list[list[tuple[list[int], SamplingParams]]]:
    base, others = _shared_prefix_prompts(seed)
    return [[(base, _params(3, sampled))], [(p, _params(i, sampled)) for i, p in enumerate(others)]]


def test_greedy_outputs_with_cache_equal_outputs_without(partly_trained: Path) -> None:
    # Chunked prefill (20 tokens a step) and too few blocks for the whole second wave: preemption too.
    # (Acceptance patterns are not compared here: the token budget limits drafts differently once the
    # prefills are shorter. The replay test checks them.)
    engine_args = dict(num_speculative_tokens=3, block_size=BLOCK, max_num_batched_tokens=20, num_kv_blocks=30)
    waves = _waves(5, sampled=False)
    off, _, off_hits = _run(partly_trained, waves, enable_prefix_caching=False, **engine_args)
    on, llm, hits = _run(partly_trained, waves, enable_prefix_caching=True, **engine_args)
    assert off_hits == [0] * NUM_GROUPS
    assert all(h > 0 for h in hits), f"every group must be served from the cache: {hits}"
    assert llm.engine.scheduler.num_preemptions > 0
    assert {r: o.token_ids for r, o in on.items()} == {r: o.token_ids for r, o in off.items()}
    # Async scheduling too: blocks are offered only once committed, never while a step may still write them.
    overlapped, llm, _ = _run(partly_trained, waves, async_scheduling=True, **engine_args)
    assert llm.engine.num_overlapped_steps > 0
    assert {r: o.token_ids for r, o in overlapped.items()} == {r: o.token_ids for r, o in off.items()}


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_seeded_outputs_with_cache_equal_outputs_without(partly_trained: Path, overlapped: bool) -> None:
    """One request at a time (a seeded sample depends on how many drafts each step verifies, so the
    schedule must not depend on the batch), each prefilled in chunks of 9 tokens. With overlapped steps (the
    default on CUDA) too: a request near max_tokens verifies as many drafts as in a synchronous step."""
    engine_args = dict(num_speculative_tokens=3, block_size=BLOCK, max_num_batched_tokens=9, num_kv_blocks=64,
                       async_scheduling=overlapped)
    base, *others = [request for wave in _waves(6, sampled=True) for request in wave]
    waves = [[base]] + [[request] for request in others[4:13] + others[-2:]]  # prefixes 5..13 (every residue), 29, 30
    off, _, _ = _run(partly_trained, waves, enable_prefix_caching=False, **engine_args)
    on, _, hits = _run(partly_trained, waves, enable_prefix_caching=True, **engine_args)
    assert all(h > 0 for h in hits), hits
    for req_id, out in off.items():
        assert on[req_id].token_ids == out.token_ids, req_id
        assert on[req_id].accepted_per_step == out.accepted_per_step, req_id
        if on[req_id].accepted_per_step:  # the first drafts came out of the (shorter) prefill step
            unverified_steps = len(out.token_ids) - 1 - sum(a + 1 for a in on[req_id].accepted_per_step)
            assert unverified_steps in (0, 1), req_id  # only the last token may come without drafts


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["depth", "recursive"])
def test_replay_holds_with_cache_hits(partly_trained: Path, mode: str, overlapped: bool) -> None:
    base, others = _shared_prefix_prompts(7)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    chosen = others[7:13] + others[-2:]  # prefixes 8..13 (around a boundary), 29 and the full base
    done, _, hits = _run(partly_trained, [[(base, greedy)], [(p, greedy) for p in chosen]],
                         num_speculative_tokens=3, block_size=BLOCK, num_kv_blocks=128, mtp_chain=mode,
                         async_scheduling=overlapped)
    assert all(h > 0 for h in hits), hits
    ref = Reference(partly_trained)
    for i, prompt in enumerate([base] + chosen):
        out = done["0-0" if i == 0 else f"1-{i - 1}"]
        assert out.accepted_per_step == _replay(ref, prompt + out.token_ids, len(prompt), 3, 24, mode)


def test_lookahead_rule_per_group(partly_trained: Path) -> None:
    """A prompt sharing exactly 2 blocks plus r tokens of a cached request reuses 2 blocks in every group
    only when r > m for each module m the request uses; otherwise one block fewer (all groups start from
    the same frontier, since module m at its first position needs the hidden states below it)."""
    base = prompts_of(64, [20], seed=3)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(partly_trained), num_speculative_tokens=3, block_size=BLOCK)
    llm.generate([base], greedy)
    scheduler = llm.engine.scheduler
    for r in range(BLOCK):
        for k in range(4):
            prompt = base[: 2 * BLOCK + r] + [base[2 * BLOCK + r] % 63 + 1, 62, 61]  # differs right after
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
            llm.engine.add_request(f"r{r}k{k}", prompt, params)
            scheduler.schedule()
            cached = scheduler.requests[f"r{r}k{k}"].num_computed
            deepest_module = min(k, 3) - 1  # module m needs m + 1 tokens past a block
            assert cached == (2 * BLOCK if r > deepest_module else BLOCK), (r, k)
            llm.engine.abort_request(f"r{r}k{k}")
    assert llm.engine.blocks.all_free


def test_eviction_under_pressure_and_aborts_leak_nothing(trained_ckpt: Path) -> None:
    base, others = _shared_prefix_prompts(9)
    waves = [[(base, _params(3, False))], [(p, _params(i, True)) for i, p in enumerate(others)],
             [(p, _params(i + 1, False)) for i, p in enumerate(others[::2])]]
    engine_args = dict(num_speculative_tokens=3, block_size=BLOCK, max_num_batched_tokens=16, num_kv_blocks=24)
    aborts = {"1-2": 2, "1-9": 5, "2-1": 0, "2-4": 7}
    on, llm, hits = _run(trained_ckpt, waves, abort_at=aborts, **engine_args)
    off, _, _ = _run(trained_ckpt, waves, abort_at=aborts, enable_prefix_caching=False, **engine_args)
    assert all(h > 0 for h in hits)
    assert llm.engine.blocks.pools[0].num_evictions > 0 and llm.engine.scheduler.num_preemptions > 0
    assert {r for r, o in on.items() if o.finish_reason == "abort"} == set(aborts)
    for req_id, out in off.items():
        if out.finish_reason != "abort" and not req_id.startswith("1-"):  # wave 1 samples: schedule-dependent
            assert on[req_id].token_ids == out.token_ids, req_id


def test_block_pool_never_hands_out_a_referenced_block() -> None:
    pool = BlockPool(6)
    first = pool.take(3)
    for block, h in zip(first, (b"a", b"b", b"c")):
        pool.register(block, h)
    pool.give(first)  # all three cached and free; the last block of the request is evicted first
    shared = pool.lookup([b"a", b"b", b"x"], limit=3)
    assert shared == first[:2]
    pool.share(shared)
    handed = pool.take(pool.num_free)  # the 3 never-cached blocks, then the one evictable cached block
    assert sorted(handed) == sorted(set(range(6)) - set(shared)) and pool.num_evictions == 1
    assert pool.lookup([b"a", b"b"], 2) == shared and pool.lookup([b"c"], 1) == []
    assert pool.audit([handed, shared]) == []
    pool.give(handed), pool.give(shared)
    assert pool.num_free == 6 and pool.audit([]) == []


def test_a_block_is_offered_only_when_committed_and_its_lookahead_is_verified() -> None:
    blocks = KVBlockManager(num_groups=3, num_blocks=8, block_size=BLOCK, enable_caching=True)
    tokens = list(range(10, 19))  # 9 verified tokens
    hashes: list[list[bytes]] = [[], [], []]
    blocks.allocate("a", [12, 12, 12])
    blocks.offer_committed("a", tokens, 7, hashes, (0, 1, 2))  # target committed 7 positions: block 0 only
    assert [len(h) for h in hashes] == [1, 1, 1]
    blocks.offer_committed("a", tokens, 9, hashes, (0, 1, 2))
    # Target: 2 full blocks. Module 0 needs t_8 for block 1 (have it), module 1 needs t_9 (not verified yet):
    # every group's block 1 is offered in one call, once module 1's can be.
    assert [len(h) for h in hashes] == [1, 1, 1]
    assert not blocks.offer_due("a", 9) and blocks.offer_due("a", 10)
    blocks.offer_committed("a", tokens + [19, 20], 10, hashes, (0, 1, 2))
    assert [len(h) for h in hashes] == [2, 2, 2]
    assert [pool.num_cached for pool in blocks.pools] == [2, 2, 2]
    other: list[bytes] = [hashes[2][0]]
    extend_hashes(other, tokens + [77], BLOCK, 2, 2)
    assert other[1] != hashes[2][1], "module 1's block 1 covers t_9"
    # A request that finishes before its next blocks are due offers what is committed and hashable then.
    blocks.offer_committed("a", tokens + [19, 20, 21, 22], 13, hashes, (0, 1, 2), final=True)
    assert [len(h) for h in hashes] == [3, 3, 2]  # module 1's block 2 needs t_13, not verified yet
    shifted: list[bytes] = []
    extend_hashes(shifted, [99] + tokens[1:], BLOCK, 1, 2)
    assert shifted[0] != hashes[1][0], "module 0's first block covers t_0 as well"


def test_the_switch_is_a_flag_and_a_yaml_key(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args([]))[0].enable_prefix_caching is True
    assert config_from_args(parser.parse_args(["--no-enable-prefix-caching"]))[0].enable_prefix_caching is False
    (tmp_path / "c.yaml").write_text("enable_prefix_caching: false\n")
    assert load_config(tmp_path / "c.yaml", {})[0].enable_prefix_caching is False


def test_requeue_after_lost_workers_forgets_the_cache(partly_trained: Path) -> None:
    """Replaced workers hold no KV: a request requeued by the recovery path is recomputed from position 0,
    even where its blocks had been cached (reusing them would attend over the new workers' empty pools)."""
    base, _ = _shared_prefix_prompts(seed=7)
    llm = LLM(str(partly_trained), block_size=BLOCK, max_num_seqs=4)
    engine = llm.engine
    llm.generate([base], _params(3, sampled=False))  # fills every group's cache with the base prompt's blocks
    engine.add_request("again", base, _params(3, sampled=False))
    plan = engine.scheduler.schedule()  # admitted past the cached prefix
    assert any(plan.new_requests[0].num_computed)
    engine.scheduler.update(plan, engine.executor.execute(plan))

    engine.scheduler.requeue_running()  # what recovery does once the executor replaced its workers
    assert all(pool.num_cached == 0 for pool in engine.blocks.pools)
    again = engine.scheduler.schedule()
    assert [n.request_id for n in again.new_requests] == ["again"]
    assert not any(again.new_requests[0].num_computed)


def _fall_then_repeat(path: Path, caching: bool, overlapped: bool, k: list[int], schedule: Callable[[int], int]
                      ) -> tuple[dict, list[int], list[str], LLM]:
    """Request "a" at k = schedule(steps so far) (k[0]: what the patched chooser returns); then "b", repeating a's
    prompt and output, at 3. -> (outputs by id, b's prefix hits per group, the requests whose modules the workers
    caught up, the LLM)."""
    base = prompts_of(64, [30], seed=5)[0]
    llm = LLM(str(path), block_size=BLOCK, num_kv_blocks=128, enable_prefix_caching=caching,
              async_scheduling=overlapped)
    engine, runner, caught = llm.engine, llm.engine.executor.runner, []
    catch_up = runner._catch_up

    def recorded(reqs, plan):
        rewound = catch_up(reqs, plan)
        caught.extend(rid for rid, a, b in zip(plan.req_ids, plan.num_tokens, rewound.num_tokens) if b > a)
        return rewound

    runner._catch_up = recorded
    k[0], steps, outs, hits = schedule(0), 0, {}, [0] * NUM_GROUPS
    engine.add_request("a", base, SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        k[0] = schedule(steps)
    if caching:  # a's offered module blocks, before b's steps touch the pools
        with torch.inference_mode():
            offered = _offered_module_blocks(llm, runner.requests["a"], base + outs["a"].token_ids)
        assert offered >= 6 * 3, offered  # of its 16 full blocks a group, at least the prompt's
    k[0] = 3
    engine.add_request("b", base + outs["a"].token_ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        hits = [h + s for h, s in zip(hits, engine.last_stats.prefix_cache_hits or [0] * NUM_GROUPS)]
    return outs, hits, caught, llm


def _offered_module_blocks(llm: LLM, req, tokens: list[int]) -> int:
    """Every block of the request's MTP groups that is in the prefix cache holds the teacher-forced K entries of its
    positions; returns how many there are."""
    keys, runner, offered = _teacher_forced_keys(llm, tokens), llm.engine.executor.runner, 0
    for m, expected in enumerate(keys):
        cached, pool = llm.engine.blocks.pools[1 + m]._hash_of, runner.kv.mtp[m].k
        entries = pool.view(-1, *pool.shape[2:])
        for b, block in enumerate(req.block_ids[1 + m]):
            if block in cached:
                torch.testing.assert_close(entries[block * BLOCK : (block + 1) * BLOCK],
                                           expected[b * BLOCK : (b + 1) * BLOCK].to(pool.device), rtol=1e-4, atol=1e-4,
                                           msg=lambda msg: f"module {m}, block {b}: {msg}")
                offered += 1
    return offered


@pytest.mark.parametrize("falls", ["at the prompt", "in decode"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_modules_caught_up_after_a_fall_are_offered_again(partly_trained: Path, monkeypatch: pytest.MonkeyPatch,
                                                         overlapped: bool, falls: str) -> None:
    """An auto request that prefilled at k = 1 left modules 2 and 3 behind from its prompt on; once k rose to 3 a
    catch-up committed them to its frontier, and its blocks of every group are offered from there: a request that
    repeats its prompt and output reuses them in all four groups, and holds the teacher-forced entries in every
    module. Before session AN a module's blocks past its first lag were never offered, and the all-groups rule then
    left auto requests with no prefix hits at all (hits [0, 0, 0, 0] here)."""
    k = [1]
    monkeypatch.setattr(AdaptiveSpec, "choose", lambda self, rows, batch=None, newcomers_adaptive=True: k[0])
    schedule = (lambda steps: 1 if steps < 4 else 3) if falls == "at the prompt" else (
        lambda steps: 1 if steps % 6 >= 3 else 3)  # three steps at k = 3, three at 1 (modules 2 and 3 left behind), ...
    off, _, caught, _ = _fall_then_repeat(partly_trained, False, overlapped, k, schedule)
    on, hits, _, llm = _fall_then_repeat(partly_trained, True, overlapped, k, schedule)
    assert "a" in caught
    assert all(h >= 56 for h in hits), hits  # of b's 66 prompt tokens, all but the blocks past module 3's lookahead
    assert [on[r].token_ids for r in "ab"] == [off[r].token_ids for r in "ab"]
    with torch.inference_mode():
        b = llm.engine.executor.runner.requests["b"]
        assert _assert_pools_match(llm, b, _teacher_forced_keys(llm, b.token_ids), BLOCK) > 150


@pytest.mark.parametrize("fall_at", [4, 7, 11])
@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_a_fall_in_decode_offers_no_module_block_past_what_the_module_committed(
        partly_trained: Path, monkeypatch: pytest.MonkeyPatch, overlapped: bool, fall_at: int) -> None:
    """Module m commits m positions behind the target (its entries past that came from this step's drafts); where k
    falls below it and stays there, those entries are never rewritten. Offered up to the target's frontier at the
    fall, a block ending among them went to the cache with draft-made entries (five of these six cases failed so before
    session AN); the limit is now that frontier less the modules' offsets."""
    k = [3]
    monkeypatch.setattr(AdaptiveSpec, "choose", lambda self, rows, batch=None, newcomers_adaptive=True: k[0])
    _fall_then_repeat(partly_trained, True, overlapped, k, lambda steps: 3 if steps < fall_at else 1)


def test_hashes_extended_in_one_call_or_block_by_block_are_the_same_chain() -> None:
    tokens = prompts_of(64, [45], seed=12)[0]
    for lookahead in range(4):
        whole, stepwise = [], []
        extend_hashes(whole, tokens, BLOCK, lookahead, 10)
        for upto in (0, 1, 2, 5, 9, 10):
            extend_hashes(stepwise, tokens, BLOCK, lookahead, upto)
        assert whole == stepwise and len(whole) == 10 and len(set(whole)) == 10
        tail = [] + whole[:3]
        extend_hashes(tail, tokens[:3 * BLOCK + lookahead] + [t + 1 for t in tokens[3 * BLOCK + lookahead:]], BLOCK,
                      lookahead, 10)
        # A token changed in block 3 changes its hash and every one after it, none before.
        assert tail[:3] == whole[:3] and all(a != b for a, b in zip(tail[3:], whole[3:]))
