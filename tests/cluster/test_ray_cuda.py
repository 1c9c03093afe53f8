"""The Ray path on CUDA GPUs (needs >= 2): tensor parallelism over NCCL and the drafter group on its own GPU.

test_ray_equivalence.py runs these layouts on CPU over gloo; here they run as they serve, one Ray actor per
GPU and NCCL between them. The default model in float32, greedy at k = 0 and k = 3, and seeded sampling at
k = 3 (top-p; top-k with penalties, whose padded rows must stay neutral): every request's tokens must equal
the in-process engine's on one GPU. benchmarks/ray_gpu.py is the greedy check with timings.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2 CUDA GPUs (tensor-parallel ranks and the drafter group over NCCL); this machine has "
                f"{torch.cuda.device_count()}", allow_module_level=True)
ray = pytest.importorskip("ray", reason="the multi-GPU layouts run on Ray actors")

from mtpserve import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray instance and its GPU workers

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "def read_lines(path):\n    with open(path) as f:\n", "    for i, item in enumerate(items):\n",
           "def main(argv=None):\n    parser = argparse.ArgumentParser(", "try:\n    import json\nexcept", "x = ["]
KS = (0, 3)
# Float32, so that greedy equality is a fair demand of another summation order (the all-reduce's); a fixed
# default k, so start-up captures graphs for k = 0 and 3 only; the first fault fails instead of recovering.
ENGINE = dict(device="cuda", dtype="float32", max_num_seqs=8, num_speculative_tokens=max(KS), max_faults=1)


def _params() -> list[SamplingParams]:
    """Greedy at each k of KS over PROMPTS, then the prompts again sampled at k = 3 with per-request seeds:
    half top-p, half top-k with repetition, presence and frequency penalties."""
    greedy = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
              for k in KS for _ in PROMPTS]
    sampled = [SamplingParams(max_tokens=48, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True,
                              num_speculative_tokens=max(KS)) if i % 2 else
               SamplingParams(max_tokens=48, temperature=0.8, top_k=20, repetition_penalty=1.3, presence_penalty=0.4,
                              frequency_penalty=0.2, seed=200 + i, ignore_eos=True, num_speculative_tokens=max(KS))
               for i in range(len(PROMPTS))]
    return greedy + sampled


def _kind(i: int) -> str:
    """What request i of _params() is, for failure messages."""
    return f"k={KS[i // len(PROMPTS)]}" if i < len(KS) * len(PROMPTS) else "sampled k=3"


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(**ENGINE)
    try:
        outs = [o.token_ids for o in llm.generate(PROMPTS * (len(KS) + 1), _params())]
    finally:
        llm.shutdown()
    del llm
    gc.collect()  # the runner's CUDA graphs and KV pools: GPU 0 is a Ray worker's next
    torch.cuda.empty_cache()
    return outs


@pytest.fixture(scope="module")
def local_ray():
    # Not ray_helpers.start_local_ray: the GPUs are named, so placement cannot wait on a detection that missed
    # them. Workers inherit this environment: NVLink multicast stays off (shared GPU hosts forbid it).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, cuda_graphs=False),
                                    dict(drafter_devices=1)], ids=["tp2-nccl", "tp2-nccl-eager", "tp1-drafter-gpu"])
def test_matches_single_gpu(reference: list[list[int]], local_ray, layout: dict) -> None:
    """Tensor-parallel ranks replay graphs with their all-reduces captured inside (or run eagerly), with steps
    overlapped; the drafter group's rank replays its part of each step (drafter_steps.py)."""
    llm = LLM(**ENGINE, **layout)
    try:
        outs = llm.generate(PROMPTS * (len(KS) + 1), _params())
        replays = [_counters(channel)["graph_replays"] for channel in llm.engine.executor._channels]
        assert llm.engine.num_overlapped_steps > 0
    finally:
        llm.shutdown()
    graphed = layout.get("cuda_graphs", True)
    # Every rank replays its graphs: the target ranks their steps, a drafter rank its part of them.
    assert all((n > 0) == graphed for n in replays), replays
    for i, (o, expected) in enumerate(zip(outs, reference)):
        pos = next((j for j, (a, b) in enumerate(zip(o.token_ids, expected)) if a != b), None)
        assert o.token_ids == expected, (f"{_kind(i)}, prompt {i % len(PROMPTS)}: first difference at token "
                                         f"{pos if pos is not None else min(len(o.token_ids), len(expected))}")
    for name, part in (("k=3", outs[len(PROMPTS):2 * len(PROMPTS)]), ("sampled k=3", outs[2 * len(PROMPTS):])):
        drafted = [o for o in part if o.accepted_per_step]
        assert drafted and sum(o.accepted_tokens for o in drafted) > 0, f"{name}: drafts verified and some accepted"


def _counters(channel) -> dict[str, int]:
    """A worker's step counters, asked over its control channel between steps."""
    channel.send(("counters", None))
    kind, counters = channel.recv()
    assert kind == "counters"
    return counters
