#!/usr/bin/env python
"""Prefix caching on vs off: TTFT and prefill tokens computed for a shared-system-prompt workload.

    python benchmarks/prefix_cache.py                      # the embedded default model, GPU if any
    python benchmarks/prefix_cache.py --device cuda        # on one H100/H200
    python benchmarks/prefix_cache.py --tiny --device cpu  # a short smoke run

Workload: every request is one --system-len-token system prompt (the same for all) followed by a
--question-len-token question of its own (random token ids), --requests requests kept --concurrency in
flight by a closed loop (a finished request is replaced at once), --max-tokens greedy tokens each, eos
ignored, speculation at the model's default k (every MTP module). The same engine settings run twice,
once with enable_prefix_caching off and once on; a short warm-up request (its own random prompt, no
shared prefix) runs first in each engine.

Columns: TTFT p50 / p99 (submission -> first token, per request, ms), prefill tokens computed (prompt
tokens the target actually ran), hit rate (target-group tokens served from the cache / tokens queried;
the MTP groups' hit rates are listed in the notes), wall time and output tok/s of the whole run.
The check: greedy outputs with caching on equal those with caching off, request for request.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table, check, percentile  # noqa: E402

import torch  # noqa: E402

from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig  # noqa: E402
from mtpserve.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    p.add_argument("--model", default=None, help="checkpoint dir (default: mtpserve/default_model)")
    p.add_argument("--system-len", type=int, default=1536, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=24, help="tokens of each request's own question")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="float32 on a GPU: the output check is exact only there "
                   "(bf16 logits depend on the batch's shape, and a cached prefix was computed in another batch)")
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, system_len=256, requests=12, max_tokens=8)
    return args


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    """(a warm-up prompt, the requests' prompts: one shared system prompt + a question each)."""
    gen = torch.Generator().manual_seed(args.seed)
    system = torch.randint(1, vocab, (args.system_len,), generator=gen).tolist()
    questions = torch.randint(1, vocab, (args.requests, args.question_len), generator=gen).tolist()
    warmup = torch.randint(1, vocab, (args.question_len + 8,), generator=gen).tolist()
    return warmup, [system + q for q in questions]


def run(args: argparse.Namespace, device: torch.device, caching: bool) -> dict:
    engine = LLMEngine(EngineConfig(
        model=args.model, device=str(device), dtype=args.dtype, enable_prefix_caching=caching,
        block_size=args.block_size,
        max_num_seqs=max(args.concurrency, 1), max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.system_len + args.question_len + args.max_tokens + 64))
    warmup, prompts = workload(args, engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    _drain(engine, {"warmup": warmup}, params, concurrency=1)
    prefill, queries, hits = 0, [0] * len(engine.blocks.pools), [0] * len(engine.blocks.pools)

    def on_step() -> None:
        nonlocal prefill, queries, hits
        s = engine.last_stats
        prefill += s.num_prompt_tokens
        queries = [a + b for a, b in zip(queries, s.prefix_cache_queries)]
        hits = [a + b for a, b in zip(hits, s.prefix_cache_hits)]

    t0 = time.perf_counter()
    outputs, ttft = _drain(engine, {f"r{i}": p for i, p in enumerate(prompts)}, params, args.concurrency, on_step)
    wall = time.perf_counter() - t0
    engine.shutdown()
    return dict(outputs=outputs, ttft=ttft, prefill=prefill, wall=wall, queries=queries, hits=hits,
                tokens=sum(len(o) for o in outputs.values()))


def _drain(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams, concurrency: int,
           on_step=lambda: None) -> tuple[dict[str, list[int]], list[float]]:
    """Closed loop: keep `concurrency` requests in flight; -> (tokens per request, TTFT seconds per request)."""
    pending, submitted, first, outputs = list(prompts.items()), {}, {}, {}
    while pending or engine.has_unfinished_requests():
        while pending and len(submitted) - len(outputs) < concurrency:
            req_id, prompt = pending.pop(0)
            submitted[req_id] = time.perf_counter()
            engine.add_request(req_id, prompt, params)
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                outputs[out.request_id] = out.token_ids
        on_step()
    return outputs, [first[r] - submitted[r] for r in prompts]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    results = {caching: run(args, device, caching) for caching in (False, True)}
    off, on = results[False], results[True]
    check(on["outputs"] == off["outputs"], "greedy outputs with prefix caching differ from those without")
    check(on["prefill"] < off["prefill"], "prefix caching computed no fewer prefill tokens")
    table = Table(f"shared system prompt {args.system_len} + question {args.question_len} tokens, "
                  f"{args.requests} requests, concurrency {args.concurrency}, {args.max_tokens} tokens each",
                  ["prefix cache", "TTFT p50 ms", "TTFT p99 ms", "prefill tokens", "hit rate", "wall s", "out tok/s"])
    for caching, r in ((False, off), (True, on)):
        rate = r["hits"][0] / r["queries"][0] if r["queries"][0] else 0.0
        table.add("on" if caching else "off", percentile(r["ttft"], 50) * 1e3, percentile(r["ttft"], 99) * 1e3,
                  r["prefill"], f"{rate:.1%}", r["wall"], r["tokens"] / r["wall"])
    groups = ["target"] + [f"mtp{m}" for m in range(len(on["hits"]) - 1)]
    notes = [f"dtype {args.dtype}", "hit rate per KV group with caching on: " + ", ".join(
        f"{g} {h / q:.1%}" for g, h, q in zip(groups, on["hits"], on["queries"]) if q),
        "greedy outputs with caching on == off: yes"]
    common.report(args, "prefix_cache", device, [table], notes)


if __name__ == "__main__":
    main()
