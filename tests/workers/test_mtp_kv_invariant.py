"""docs/design.md §3 KV invariant, checked directly on the pools: every committed MTP KV entry equals what a
teacher-forced pass of the same module over the final verified sequence computes.

(The acceptance-replay test checks the same invariant through its effect on drafts; a tiny model's
drafts can be insensitive to one wrong KV entry, so this test reads the pools themselves.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtpserve import LLM, SamplingParams
from mtpserve.workers.models.dense import dense_layer, target_hidden
from tests.conftest import prompts_of


def _teacher_forced_keys(llm: LLM, tokens: list[int]) -> list[torch.Tensor]:
    """Per module m: the K it should hold at positions 0..S-m-2 ([n, Hkv, D]), teacher forced."""
    model = llm.engine.executor.runner.model
    target, mtp, cfg = model.target, model.mtp, model.config
    dev = target.embed_tokens.weight.device  # the engine's device: CUDA where there is one
    seq = torch.tensor([tokens], device=dev)
    h = target_hidden(target, seq)[0]
    prev = h if cfg.mtp.hidden_pre_norm else target.norm(h)
    keys = []
    for m in range(len(mtp)):
        n = len(tokens) - m - 1
        module = mtp.mtp[m]
        positions = torch.arange(n, device=dev)
        emb = (module.embed_tokens or target.embed_tokens)(seq[0, m + 1 : m + 1 + n])
        emb = emb.masked_fill((positions == 0)[:, None], 0.0) if cfg.mtp.mask_position0 else emb
        e, hh = module.enorm(emb), module.hnorm(prev[:n])
        x = module.eh_proj(torch.cat((hh, e) if cfg.mtp.hidden_first else (e, hh), dim=-1))
        attn = module.block.self_attn
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        k = attn.qkv_proj(module.block.input_layernorm(x))[:, q_size : q_size + kv_size]
        k = k.view(n, attn.num_kv_heads, attn.head_dim)
        k = attn.k_norm(k) if attn.k_norm is not None else k
        keys.append(attn.rotary(k, positions))
        g = dense_layer(module.block, x[None], positions)[0]
        prev = mtp.next_hidden(m, g)
    return keys


def test_committed_mtp_kv_equals_teacher_forced(partly_trained: Path) -> None:
    llm = LLM(str(partly_trained), num_speculative_tokens=3, block_size=4)
    prompts = prompts_of(64, [5, 13, 2], seed=4)
    runner = llm.engine.executor.runner
    checked = 0
    with torch.inference_mode():
        for prompt in prompts:  # one at a time: a finished request stays on the worker until the next plan
            out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
            req = runner.requests[out.request_id]
            expected = _teacher_forced_keys(llm, prompt + out.token_ids)
            checked += _assert_pools_match(llm, req, expected, 4)
    assert checked > 50


def _assert_pools_match(llm: LLM, req, keys: list[torch.Tensor], block_size: int) -> int:
    """Compare every committed MTP K entry of `req` (a worker-side request) with the teacher-forced keys."""
    runner, checked = llm.engine.executor.runner, 0
    for m, expected in enumerate(keys):
        committed = req.mtp_computed[m]
        pos = torch.arange(committed)
        slots = torch.tensor(req.block_ids[1 + m])[pos // block_size] * block_size + pos % block_size
        pool = runner.kv.mtp[m].k.view(-1, *runner.kv.mtp[m].k.shape[2:])
        slots = slots.to(pool.device)
        torch.testing.assert_close(pool[slots], expected[:committed], rtol=1e-4, atol=1e-4,
                                   msg=lambda msg: f"module {m}: {msg}")
        checked += committed
    return checked


def test_mtp_kv_after_a_prefix_cache_hit_equals_teacher_forced(partly_trained: Path) -> None:
    """A request that starts from cached blocks (in every MTP group) holds, in those blocks and in the ones
    it computed past them, exactly the teacher-forced entries of its own sequence."""
    llm = LLM(str(partly_trained), num_speculative_tokens=3, block_size=4, enable_prefix_caching=True)
    runner = llm.engine.executor.runner
    base = prompts_of(64, [27], seed=6)[0]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        first = llm.generate([base], greedy)[0]
        first_blocks = runner.requests[first.request_id].block_ids
        for length in (13, 14, 15, 16, 22):  # a block boundary, and 1, 2, 3 past it (module m needs m + 1)
            prompt = base[:length] + prompts_of(64, [5], seed=length)[0]
            out = llm.generate([prompt], greedy)[0]
            req = runner.requests[out.request_id]
            shared = [sum(a == b for a, b in zip(mine, theirs)) for mine, theirs in zip(req.block_ids, first_blocks)]
            # Module 2 reuses a block only with 3 matching tokens past it; every group starts there.
            assert min(shared) >= (length - 3) // 4 >= 2, f"prefix {length}: blocks shared per group {shared}"
            checked = _assert_pools_match(llm, req, _teacher_forced_keys(llm, prompt + out.token_ids), 4)
            assert checked > 3 * len(prompt)
