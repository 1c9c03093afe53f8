"""GPU self-check of CUDA-graph replay (mtpserve/workers/cuda_graphs.py) on the default model.

For k = 0..3, generates greedily with cuda_graphs=False and with cuda_graphs=True and compares:
  * float32, batches of 5 (padded to bucket 8) and of 32: outputs must be identical token for token
    (exit status 1 otherwise);
  * bfloat16 (the engine's CUDA default), batch 32, timed after a full warm-up run: tok/s of both.
    Outputs are compared too, but only reported: bf16 is where a padded shape's different GEMM kernel
    could flip a near-tie, which is not a bug of the graph path (float32 would show a real one).
It also checks that graphs were replayed at all (the fraction of target forwards they served).

Run on a GPU host from the repository root (about a minute):  python tools/cuda_graph_check.py
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from mtpserve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "    for i in range(len(items)):\n", "def parse_args(argv=None):\n", "    try:\n        import ssl\n",
           "def _read_config(path):\n    with open(path) as f:\n", "class Error(Exception):\n"]


def prompts(n: int) -> list[str]:
    return (PROMPTS * (n // len(PROMPTS) + 1))[:n]


def first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        j = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if j is not None or len(x) != len(y):
            return f"request {i} at token {j if j is not None else min(len(x), len(y))}"
    return "none"


def run(k: int, graphs: bool, dtype: str, batches: list[int], max_tokens: int,
        timed: bool) -> tuple[list[list[list[int]]], float, str]:
    """-> (outputs per batch, tok/s of the last batch, graph usage), in a fresh engine."""
    llm = LLM(num_speculative_tokens=k, cuda_graphs=graphs, dtype=dtype)
    runner = llm.engine.executor.runner
    assert (runner.graphs is not None) == graphs, "cuda_graphs did not reach the runner"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs, tok_s = [], 0.0
    for batch in batches:
        if timed:
            llm.generate(prompts(batch), params)  # warm-up: kernels compile, graphs are captured
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = llm.generate(prompts(batch), params)
        torch.cuda.synchronize()
        outs.append([o.token_ids for o in res])
        tok_s = sum(len(o.token_ids) for o in res) / (time.perf_counter() - t)
    usage = f"{runner.graphs.replays} replays, {len(runner.graphs.steps)} graphs" if graphs else "eager"
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, tok_s, usage


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    failed = False
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for k in range(4):
        ref, _, _ = run(k, False, "float32", [5, args.batch], args.max_tokens, timed=False)
        got, _, usage = run(k, True, "float32", [5, args.batch], args.max_tokens, timed=False)
        for batch, a, b in zip([5, args.batch], ref, got):
            same = a == b
            failed |= not same
            print(f"float32  k={k} batch={batch:3d}: graphs == eager: {same} (first divergence: "
                  f"{first_divergence(a, b)}); {usage}")
    for k in range(4):
        (ref,), eager_tps, _ = run(k, False, "auto", [args.batch], args.max_tokens, timed=True)
        (got,), graph_tps, usage = run(k, True, "auto", [args.batch], args.max_tokens, timed=True)
        print(f"bfloat16 k={k} batch={args.batch:3d}: eager {eager_tps:8.0f} tok/s, graphs {graph_tps:8.0f} tok/s "
              f"(x{graph_tps / eager_tps:.2f}); outputs equal: {ref == got} (first divergence: "
              f"{first_divergence(ref, got)}); {usage}")
    print("FAILED: float32 outputs differ" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
