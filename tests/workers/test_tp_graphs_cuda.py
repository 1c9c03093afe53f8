"""CUDA graphs of a tensor-parallel rank: the all-reduces and the head's all-gather captured inside them.

A one-rank NCCL group on one GPU runs the sharded model (every row-parallel product all-reduces, the
vocabulary-parallel embedding and head go through NCCL) with graphs on, and must give the unsharded engine's
tokens; tests/cluster/test_ray_cuda.py runs two ranks where two GPUs exist.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available() or not dist.is_nccl_available():
    pytest.skip("needs a CUDA GPU with NCCL: CUDA graphs and the NCCL collectives captured in them exist only "
                "there (tests/cluster/test_ray_equivalence.py runs tensor parallelism on the CPU over gloo)",
                allow_module_level=True)

from mtpserve import SamplingParams  # noqa: E402
from mtpserve.cluster.engine import LLMEngine  # noqa: E402
from mtpserve.cluster.engine_config import EngineConfig, ResolvedConfig  # noqa: E402
from mtpserve.workers.local_executor import LocalExecutor  # noqa: E402
from mtpserve.workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from mtpserve.workers.models.loader import ModelSource, load_model  # noqa: E402
from mtpserve.workers.tensor_parallel import TPGroup, VocabParallelHead, shard_model  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n", "x = ["]
ENGINE = dict(device="cuda", dtype="float32", max_num_seqs=8, num_speculative_tokens=3, seed=0)


class ShardedExecutor(LocalExecutor):
    """The in-process executor over the model sharded for a one-rank tensor-parallel group."""

    def __init__(self, source: ModelSource, config: RunnerConfig) -> None:
        model = load_model(source.path, source.dtype, source.device)
        shard_model(model.target, model.mtp, TPGroup(0, 1, None))
        assert isinstance(model.target.lm_head, VocabParallelHead)
        self.runner = ModelRunner(model, config, source.dtype, source.device)
        self.start_step_costs = []


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def test_sharded_rank_replays_graphs_with_collectives(nccl_group: None) -> None:
    config = EngineConfig(**ENGINE)
    plain = LLMEngine(config)
    expected = [o.token_ids for o in _generate(plain)]
    plain.shutdown()
    resolved = ResolvedConfig.resolve(config)
    executor = ShardedExecutor(resolved.model_source(), resolved.runner_config())
    sharded = LLMEngine(config, executor=executor)
    assert [o.token_ids for o in _generate(sharded)] == expected
    uniform = executor.runner.uniform
    assert uniform.use_graphs and uniform.runs > 0 and uniform.replays == uniform.runs
    assert sharded.num_overlapped_steps > 0


def _generate(engine: LLMEngine) -> list:
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
              for k in (0, 3) for _ in PROMPTS]
    for i, p in enumerate(params):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], p)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[str(i)] for i in range(len(params))]
