#!/usr/bin/env python
"""Hugging Face `generate` vs mtpserve (no speculation) on the same 8B-shaped Llama checkpoint.

    python benchmarks/baseline.py                          # Llama-3-8B shapes, bf16, cuda; ~16 GB on disk
    python benchmarks/baseline.py --workdir /big/disk      # where the temporary checkpoint goes
    python benchmarks/baseline.py --tiny --device cpu      # a tiny llama, seconds

Random bf16 weights are drawn on the device one tensor at a time and written shard by shard
(--shard-gb) as a LlamaForCausalLM checkpoint (config.json, model-0000N-of-0000M.safetensors and the
index) into a temporary directory that is removed afterwards (--keep keeps it). Both engines then
load it from disk, one after the other (HF first, freed before mtpserve loads), and generate
--new-tokens tokens greedily for --batches batches of --prompt-len random-token prompts, eos ignored.

HF: model.generate (eager, SDPA attention, dynamic cache), all prompts in one call (same length, no
padding). mtpserve: LLM(..., num_speculative_tokens=0).generate on token-id prompts, the whole batch
prefilled in one step (max_num_batched_tokens >= batch * prompt length) like HF. Each timing is
the median of --repeats calls after a short warm-up call; tok/s = batch * new tokens / time.
The check: greedy outputs of the two should agree (first token, common prefix); with random bf16
weights near-ties can flip later tokens, so on CUDA the agreement is reported, on --tiny (fp32)
required for the first token.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Table, check  # noqa: E402
import torch  # noqa: E402

from mtpserve.sampling_params import SamplingParams  # noqa: E402
from mtpserve.workers.models.config import ModelConfig  # noqa: E402
from mtpserve.workers.models.weight_names import target_specs  # noqa: E402

Outputs = list[list[int]]
Results = dict[int, tuple[float, Outputs]]  # batch -> (median seconds, generated tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p)
    common.add_llama8b_shape_args(p)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="timed calls per (engine, batch); the median is kept")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--workdir", type=Path, default=None, help="parent of the temporary checkpoint dir")
    p.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.tiny_defaults(p, args, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                         vocab=512, batches="1,4", prompt_len=16, new_tokens=32,
                         shard_gb=0.0002)  # several shards even when tiny
    return args


def hf_config(a: argparse.Namespace) -> dict[str, Any]:
    theta = 500000.0
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab,
        "hidden_size": a.hidden, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": 0.02, "dtype": "bfloat16", "torch_dtype": "bfloat16",
    }


@torch.no_grad()
def write_checkpoint(path: Path, raw: dict[str, Any], dtype: torch.dtype, device: torch.device, shard_bytes: int,
                     seed: int) -> int:
    """Random weights drawn on the device, written shard by shard; returns the bytes written."""
    from safetensors.torch import save_file

    cfg = ModelConfig.from_dict(raw)
    specs = target_specs(cfg)  # HF names and shapes of a Llama target
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[list[str]] = [[]]
    sizes = [0]
    for spec in specs:  # group names into shards first, so file names can say "of N"
        size = math.prod(spec.shape) * torch.finfo(dtype).bits // 8
        if sizes[-1] and sizes[-1] + size > shard_bytes:
            shards.append([]), sizes.append(0)
        shards[-1].append(spec.ckpt_name)
        sizes[-1] += size
    shape = {s.ckpt_name: s.shape for s in specs}
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.empty(shape[name], dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()  # one shard on the host at a time
            weight_map[name] = fname
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return sum(sizes)


def timed(fn: Callable[[], Outputs], device: torch.device, repeats: int) -> tuple[float, Outputs]:
    """Median seconds over `repeats` calls of fn (which returns its outputs), and the last outputs."""
    out: Outputs = []

    def call() -> None:
        nonlocal out
        out = fn()

    return common.median(common.time_ms(call, device, 0, repeats)) / 1e3, out


def run_hf(path: Path, prompts: list[list[int]], batches: list[int], args: argparse.Namespace,
           device: torch.device, dtype: torch.dtype) -> tuple[Results, float]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    t0 = time.perf_counter()
    try:  # straight to the device; without accelerate some versions refuse device_map
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    except Exception:  # noqa: BLE001 (any refusal: load on the host, then move)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    common.sync(device)
    load_s = time.perf_counter() - t0

    def gen(batch: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    results = {}
    for b in batches:
        gen(prompts[:b], 4)  # warm-up: allocator, cuBLAS handles, kernel selection
        seconds, tokens = timed(lambda: gen(prompts[:b], args.new_tokens), device, args.repeats)
        results[b] = (seconds, tokens)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results, load_s


def run_mtpserve(path: Path, prompts: list[list[int]], batches: list[int], args: argparse.Namespace,
                 device: torch.device, dtype: torch.dtype) -> tuple[Results, float]:
    from mtpserve import LLM

    block = 16
    blocks = max(batches) * math.ceil((args.prompt_len + args.new_tokens + 32) / block) + 16
    t0 = time.perf_counter()
    llm = LLM(str(path), num_speculative_tokens=0, device=str(device), dtype=str(dtype).removeprefix("torch."),
              max_num_seqs=max(batches), num_kv_blocks=blocks, block_size=block,
              max_num_batched_tokens=max(2048, max(batches) * args.prompt_len))
    common.sync(device)
    load_s = time.perf_counter() - t0

    def gen(batch: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(batch, params)]

    results = {}
    for b in batches:
        gen(prompts[:b], 4)  # warm-up: Triton compilation for this batch's shapes
        results[b] = timed(lambda: gen(prompts[:b], args.new_tokens), device, args.repeats)
    llm.shutdown()
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results, load_s


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float, float]:
    """(first-token agreement, exact-match fraction, mean common-prefix length) over a batch."""
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n)
    return (sum(x[:1] == y[:1] for x, y in zip(a, b)) / len(a), sum(x == y for x, y in zip(a, b)) / len(a),
            sum(prefix) / len(prefix))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device, args.tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = common.parse_ints(args.batches)
    raw = hf_config(args)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, args.vocab, (max(batches), args.prompt_len), generator=gen).tolist()

    tmp = Path(tempfile.mkdtemp(prefix="mtpserve-baseline-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        size = write_checkpoint(tmp, raw, dtype, device, max(1, int(args.shard_gb * 1e9)), args.seed)
        write_s = time.perf_counter() - t0
        print(f"wrote {size / 1e9:.2f} GB to {tmp} in {write_s:.1f} s; device {common.device_name(device)}")
        hf, hf_load = run_hf(tmp, prompts, batches, args, device, dtype)
        print(f"HF: loaded in {hf_load:.1f} s; " + ", ".join(f"batch {b}: {s:.2f} s" for b, (s, _) in hf.items()))
        ours, our_load = run_mtpserve(tmp, prompts, batches, args, device, dtype)
        print(f"mtpserve: loaded in {our_load:.1f} s; " + ", ".join(f"batch {b}: {s:.2f} s" for b, (s, _) in ours.items()))
    finally:
        if args.keep:
            print(f"kept checkpoint at {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    n = args.new_tokens
    table = Table(f"greedy, {args.prompt_len}-token prompts, {n} new tokens, {dtype}",
                  ["batch", "HF tok/s", "mtpserve tok/s", "mtpserve/HF", "HF ms/tok", "mtpserve ms/tok",
                   "first tok =", "exact =", "common prefix"])
    problems = []
    for b in batches:
        (hs, ht), (ms, mt) = hf[b], ours[b]
        check(all(len(t) == n for t in ht) and all(len(t) == n for t in mt), f"batch {b}: both emit {n} tokens")
        first, exact, prefix = agreement(ht, mt)
        if first < (1.0 if args.tiny else 0.5):
            problems.append(f"batch {b}: first tokens agree for only {first:.0%} of requests")
        table.add(str(b), f"{b * n / hs:.1f}", f"{b * n / ms:.1f}", hs / ms, hs / n * 1e3, ms / n * 1e3,
                  first, exact, f"{prefix:.1f}")
    notes = [f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
             f"intermediate {args.intermediate}, vocab {args.vocab}; random weights ({size / 1e9:.2f} GB)",
             f"checkpoint write {write_s:.1f} s; load: HF {hf_load:.1f} s, mtpserve {our_load:.1f} s",
             f"timings: median of {args.repeats} after a 4-token warm-up; ms/tok = time per decode step of the batch"]
    notes += [f"WARNING: {p}" for p in problems]
    common.report(args, "baseline", device, [table], notes)
    check(not (args.tiny and problems), "; ".join(problems))  # after the report: the numbers stay recorded
    return 0


if __name__ == "__main__":
    sys.exit(main())
