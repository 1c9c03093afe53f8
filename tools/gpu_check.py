"""GPU smoke check of the engine: the default model on CUDA, k = 0..3, agreement and speed per k.

Prints tokens/s, acceptance length, the fraction of output tokens equal to k = 0's, and a
profile of the busiest step phases. Run on a GPU host: python tools/gpu_check.py
"""

from __future__ import annotations

import argparse
import time

import torch

from mtpserve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "    for i in range(len(items)):\n", "def parse_args(argv=None):\n", "    try:\n        import ssl\n",
           "def _read_config(path):\n    with open(path) as f:\n", "class Error(Exception):\n"]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions (up to the first divergence, per request) where outputs agree."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same, total = same + n, total + max(len(x), len(y))
    return same / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    prompts = (PROMPTS * (args.batch // len(PROMPTS) + 1))[: args.batch]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    base = None
    for k in (0, 1, 2, 3):
        llm = LLM(num_speculative_tokens=k)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up: kernels compile
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        toks = [o.token_ids for o in outs]
        base = base or toks
        s = llm.engine.spec
        steps = sum(len(o.accepted_per_step) for o in outs)
        print(f"k={k} batch={args.batch} tok/s={sum(map(len, toks)) / dt:8.1f} wall={dt:6.2f}s "
              f"acc_len={s.acceptance_length:.3f} agree_with_k0={agreement(toks, base):.3f} verify_steps={steps}")
        if args.profile and k == 3:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
