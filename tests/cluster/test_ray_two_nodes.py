"""Two Ray nodes on one machine (`ray start --head` + `ray start --address=...`, each with its own
custom resource): the target group placed on one, the drafter group on the other, and the outputs
still those of the single-process engine. The driver runs in its own process
(tests/cluster/ray_two_node_driver.py), as a deployment's driver would.

The fixture starts both nodes with `--block` and stops them by terminating exactly those processes
(a node started with --block shuts its own Ray processes down on SIGTERM), never with `ray stop`,
which would also stop any other Ray instance on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.cluster.ray_helpers import generate

pytestmark = pytest.mark.slow  # several processes (Ray workers), each importing torch


# Token authentication off for this throwaway local cluster and its driver: Ray decides a process's
# mode once, so every process here is started with the same setting.
_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], log: Path) -> subprocess.Popen:
    ray_cli = str(Path(sys.executable).with_name("ray"))
    return subprocess.Popen([ray_cli, "start", "--block", "--disable-usage-stats", *args], env=_ENV,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"`ray start` did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("ray_nodes")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    procs = [_ray_start(["--head", f"--port={port}", f"--temp-dir=/tmp/mtp_ray_{os.getpid()}", "--num-cpus=3",
                         "--include-dashboard=false", '--resources={"node_a": 4}'], logs / "head.log")]
    try:
        _wait_for_line(logs / "head.log", "Ray runtime started", procs[0], timeout=120)
        procs.append(_ray_start([f"--address={address}", "--num-cpus=3", '--resources={"node_b": 4}'],
                                logs / "worker.log"))
        _wait_for_line(logs / "worker.log", "Ray runtime started", procs[1], timeout=120)
        yield address
    finally:
        for proc in reversed(procs):  # the worker node first, then the head
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this fixture started


def test_target_and_drafters_on_different_nodes(two_nodes: str, partly_trained: Path, tmp_path: Path) -> None:
    """Three drafters for three modules: the chain crosses from rank to rank, after crossing nodes."""
    expected, _ = generate(partly_trained)
    out = tmp_path / "outputs.json"
    subprocess.run([sys.executable, "-m", "tests.cluster.ray_two_node_driver", two_nodes, str(partly_trained),
                    str(out)], env=_ENV, cwd=Path(__file__).resolve().parents[2], check=True, timeout=300)
    got = json.loads(out.read_text())
    assert "node_a" in got["placed"]["target worker (rank 0)"]
    assert all("node_b" in got["placed"][f"drafter worker (rank {r})"] for r in (1, 2, 3))
    assert [o["token_ids"] for o in got["outputs"]] == [o.token_ids for o in expected]
    assert [o["accepted"] for o in got["outputs"]] == [o.accepted_per_step for o in expected]
    assert [o["logprobs"] for o in got["outputs"]] == [o.logprobs is not None for o in expected]
