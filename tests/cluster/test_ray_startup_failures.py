"""Start-up failures end the deployment with an error naming the cause, within a bounded time.

Each case must also leave the cluster clean: no placement group or worker left behind that would
keep the next deployment from being placed.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.util import placement_group_table

from mtpserve import LLM
from mtpserve.errors import CheckpointError, DeploymentError, ReplicaFailed
from tests.checkpoints import make_hf_checkpoint
from tests.cluster.ray_helpers import start_local_ray

pytestmark = pytest.mark.slow  # several processes (Ray workers), each importing torch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("ray_fail_ckpt"), num_mtp=2, vocab_size=64)


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


def _no_leftovers() -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        live = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not live and ray.available_resources().get("CPU", 0) == 4:
            return
        time.sleep(0.2)
    raise AssertionError(f"left behind: {live}, available {ray.available_resources()}")


def test_bad_checkpoint_path(tmp_path: Path, local_ray) -> None:
    with pytest.raises(CheckpointError, match="is not a directory"):
        LLM(str(tmp_path / "missing"), tensor_parallel_size=2)


def test_corrupt_weights_fail_in_the_workers(ckpt: Path, tmp_path: Path, local_ray) -> None:
    """config.json is fine (the driver reads only that); the tensors are cut short, which only a worker sees."""
    bad = tmp_path / "corrupt"
    shutil.copytree(ckpt, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    t0 = time.monotonic()
    with pytest.raises(DeploymentError, match=r"(target|drafter) worker \(rank \d\) failed during start-up: "
                                              r"CheckpointError: cannot load the checkpoint at .*corrupt"):
        LLM(str(bad), drafter_devices=1, startup_timeout_s=60)
    assert time.monotonic() - t0 < 60
    _no_leftovers()


def test_more_gpus_than_the_cluster_has(ckpt: Path, local_ray) -> None:
    t0 = time.monotonic()
    with pytest.raises(DeploymentError, match=r"cannot provide 2 x \{'CPU': 1.0, 'GPU': 1.0\} on one node"):
        LLM(str(ckpt), device="cuda", num_kv_blocks=16, tensor_parallel_size=2, placement_timeout_s=2)
    assert time.monotonic() - t0 < 15
    _no_leftovers()


def test_resources_no_node_has(ckpt: Path, local_ray) -> None:
    with pytest.raises(DeploymentError, match=r"drafter group.*Nodes: "):
        LLM(str(ckpt), tensor_parallel_size=2, drafter_devices=1, drafter_resources={"drafter_node": 1},
            placement_timeout_s=2)
    _no_leftovers()


@pytest.mark.parametrize(("fault", "tp", "drafters"), [("target:1:load", 2, 0), ("drafter:1:init", 1, 1)])
def test_worker_dies_during_start_up(ckpt: Path, local_ray, monkeypatch: pytest.MonkeyPatch, fault: str,
                                     tp: int, drafters: int) -> None:
    """The other worker waits for the dead one (in the rendezvous, or in creating the groups); the
    deployment must not wait with it."""
    monkeypatch.setenv("MTPSERVE_TEST_FAULT", fault)
    role, rank, _ = fault.split(":")
    t0 = time.monotonic()
    with pytest.raises(DeploymentError, match=rf"{role} worker \(rank {rank}\) died during start-up"):
        LLM(str(ckpt), tensor_parallel_size=tp, drafter_devices=drafters, startup_timeout_s=120)
    assert time.monotonic() - t0 < 60
    _no_leftovers()


def test_tensor_parallel_size_must_divide_the_heads(ckpt: Path, local_ray) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide this model's num_attention_heads"):
        LLM(str(ckpt), tensor_parallel_size=3)


def test_more_drafter_devices_than_modules(ckpt: Path, local_ray) -> None:
    with pytest.raises(ValueError, match=r"drafter_devices: 3 devices for 2 MTP module\(s\) in use"):
        LLM(str(ckpt), drafter_devices=3)


def test_a_driver_without_gpus_must_be_told_the_kv_size(ckpt: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this driver has a GPU to size the KV cache from")
    with pytest.raises(ValueError, match=r"num_kv_blocks: this process has no GPU"):
        LLM(str(ckpt), device="cuda", tensor_parallel_size=2)


def test_a_worker_that_dies_in_every_warm_up_ends_the_start_and_leaves_nothing(ckpt: Path, local_ray,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile warm-up (cluster/warmup.py) is the first step with requests of every incarnation of the workers:
    each dies there, is replaced within the fault budget, and past it the start fails with the workers stopped."""
    monkeypatch.setenv("MTPSERVE_TEST_FAULT", "drafter:1:step")
    with pytest.raises(ReplicaFailed, match=r"after 2 worker faults.*warm-up: "):
        LLM(str(ckpt), drafter_devices=1, compile_warmup=True, max_faults=2, startup_timeout_s=120)
    _no_leftovers()
