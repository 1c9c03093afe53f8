"""Multi-GPU check on Ray: tp = 2, and tp = 2 plus a drafter group of 2, against tp = 1.

For each configuration the same greedy requests run with k = 0..3 (per-request override) on the
default model (or --model): outputs are compared token for token with tp = 1, in fp32 (where
they must be identical) and bf16 (where sharded reductions may round differently: agreement is
reported), and the mean engine step time of a batch with k = 3 is measured.
Run on a host with >= 4 GPUs and Ray: python tools/tp_gpu_check.py
"""

from __future__ import annotations

import argparse
import time

import torch

from mtpserve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "    for i in range(len(items)):\n", "def parse_args(argv=None):\n", "    try:\n        import ssl\n",
           "def _read_config(path):\n    with open(path) as f:\n", "class Error(Exception):\n",
           "    def __repr__(self):\n", "def read_lines(path, encoding='utf-8'):\n", "if __name__ == '__main__':\n",
           "    @property\n    def name(self):\n"]
CONFIGS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "tp2+G2": {"tensor_parallel_size": 2, "drafter_devices": 2}}


def outputs_by_k(llm: LLM, max_tokens: int) -> dict[int, list[list[int]]]:
    return {k: [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k))] for k in range(4)}


def step_time(llm: LLM, batch: int, max_tokens: int) -> tuple[float, int]:
    """Mean wall time per engine step for `batch` requests decoding with k = 3."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"t{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=3))
    engine.step()  # the prefill step
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1), steps


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    if torch.cuda.is_available():
        print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    for dtype in args.dtypes.split(","):
        reference = None
        for name, cfg in CONFIGS.items():
            t0 = time.perf_counter()
            llm = LLM(args.model, dtype=dtype, num_speculative_tokens=3, **cfg)
            started = time.perf_counter() - t0
            outs = outputs_by_k(llm, args.max_tokens)
            reference = reference or outs
            same = {k: same_fraction(outs[k], reference[k]) for k in outs}
            k_invariant = all(outs[k] == outs[0] for k in outs)
            per_step, steps = step_time(llm, args.batch, args.max_tokens)
            llm.shutdown()
            print(f"{dtype:9s} {name:7s} start {started:5.1f}s  identical to tp1 (k=0..3): "
                  f"{' '.join(f'{same[k]:.2f}' for k in sorted(same))}  same for every k: {k_invariant}  "
                  f"step {per_step * 1e3:6.2f} ms ({steps} steps, batch {args.batch}, k=3)", flush=True)


if __name__ == "__main__":
    main()
