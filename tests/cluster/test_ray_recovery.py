"""A replica survives the loss of a worker (mtpserve/cluster/recovery.py), over gRPC on loopback.

One replica (a target rank and a drafter-group member, Ray on this machine) serves the same streams
undisturbed, then while its target worker is killed, while its drafter is killed, and while its target
hangs (the test hook RayExecutor.inject_fault): each time every stream completes with exactly the
undisturbed output (greedy and seeded), health goes NOT_SERVING and back, and every KV block is free
afterwards. A second replica whose workers die at every first step exhausts its fault budget: the
streams end UNAVAILABLE naming the cause, and nothing hangs.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtpserve import SamplingParams
from mtpserve.cluster import warmup
from mtpserve.cluster.client import Client, build_request
from mtpserve.cluster.engine_config import EngineConfig
from mtpserve.cluster.router import RETRY_METADATA_KEY
from mtpserve.cluster.serve import ServerOptions, ServerThread, load_engine
from mtpserve.v1 import generation_pb2_grpc as pb_grpc
from mtpserve.workers.worker import FAULT_ENV
from tests.cluster.ray_helpers import start_local_ray
from tests.conftest import prompts_of

pytestmark = pytest.mark.slow  # Ray workers: several processes, each importing torch

# A token budget no step reaches: every decode step verifies all its drafts, whatever the timing (seeded
# samples depend on how many drafts are verified).
ENGINE = dict(num_kv_blocks=300, block_size=4, max_num_seqs=16, max_num_batched_tokens=1024, num_speculative_tokens=3)
PROMPTS = prompts_of(64, [3, 9, 17, 5, 30, 12], seed=21)
PARAMS = ([SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)] * 3
          + [SamplingParams(max_tokens=64, temperature=0.9, top_p=0.9, seed=40 + i, ignore_eos=True,
                            repetition_penalty=1.1 if i % 2 else 1.0) for i in range(3)])
WAIT_S = 240  # bound on any one wait: a fault must never leave a stream hanging


def start(ckpt: Path, **engine: Any) -> ServerThread:
    config = EngineConfig(model=str(ckpt), **{**ENGINE, **engine})
    # No queue beyond the running batch: max_num_seqs requests in flight fill it.
    return ServerThread(load_engine(config), ServerOptions(host="127.0.0.1", port=0, metrics_port=-1, max_queue_size=0))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def server(partly_trained: Path, local_ray: None) -> Iterator[ServerThread]:
    srv = start(partly_trained, drafter_devices=1, max_faults=10)
    yield srv
    srv.stop()


class HealthLog:
    """Every status the server's health service announces (grpc.health.v1 Watch), from a thread."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.statuses: list[str] = []
        self._changed = threading.Condition()
        self._stream = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for msg in self._stream:
                with self._changed:
                    self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status))
                    self._changed.notify_all()
        except grpc.RpcError:
            pass  # cancelled by close()

    def went_down(self, timeout: float = WAIT_S) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: "NOT_SERVING" in self.statuses, timeout)

    def went_down_and_up(self, timeout: float = 30.0) -> bool:
        """NOT_SERVING was announced, and SERVING after it (waits for the announcement in flight)."""
        def seen() -> bool:
            down = [i for i, s in enumerate(self.statuses) if s == "NOT_SERVING"]
            return bool(down) and "SERVING" in self.statuses[down[0]:] and self.statuses[-1] == "SERVING"
        with self._changed:
            return self._changed.wait_for(seen, timeout)

    def close(self) -> None:
        self._stream.cancel()
        self.channel.close()


@pytest.fixture()
def health(server: ServerThread) -> Iterator[HealthLog]:
    log = HealthLog(server.port)
    yield log
    log.close()


def metric(server: ServerThread, name: str) -> float:
    return server.replica.engine_loop.logger.registry.get_sample_value(name) or 0.0


def engine_idle(server: ServerThread) -> tuple[bool, int]:
    """(every KV block of every group free, requests the scheduler holds), read in the engine thread."""
    return server.replica.engine_loop.call(lambda e: (e.blocks.all_free, len(e.scheduler.requests))).result(30)


def run_streams(server: ServerThread, fault: Callable[[], None] | None = None) -> list[tuple[list[int], str]]:
    """The request set as concurrent streams; `fault` strikes once every stream has its first tokens."""
    started = threading.Barrier(len(PROMPTS) + 1, timeout=WAIT_S)

    def one(i: int) -> tuple[list[int], str]:
        tokens, reason, waiting = [], "", True
        with Client(f"127.0.0.1:{server.port}", timeout=WAIT_S) as c:
            for delta in c.stream(PROMPTS[i], PARAMS[i]):
                tokens += delta.token_ids
                reason = delta.finish_reason or reason
                if waiting and tokens:
                    waiting = False
                    started.wait()
        return tokens, reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
        started.wait()
        if fault is not None:
            fault()
        return [f.result(WAIT_S) for f in futures]


@pytest.fixture(scope="module")
def reference(server: ServerThread) -> list[tuple[list[int], str]]:
    outs = run_streams(server)
    assert all(reason == "length" and len(tokens) == 64 for tokens, reason in outs)
    return outs


def kill(server: ServerThread, name: str) -> Callable[[], None]:
    return lambda: os.kill(server.replica.engine.executor.worker_pids[name], signal.SIGKILL)


def hang(server: ServerThread, rank: int) -> Callable[[], None]:
    """The test hook: that worker stops answering before its next step (sent from the engine thread,
    which owns the channels); only the step timeout can notice."""
    return lambda: server.replica.engine_loop.call(lambda e: e.executor.inject_fault(rank, "hang")).result(30)


FAULTS = {
    "target killed": lambda s: kill(s, "target worker (rank 0)"),
    "drafter killed": lambda s: kill(s, "drafter worker (rank 1)"),
    "target hangs": lambda s: hang(s, 0),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_streams_survive_a_lost_worker(server: ServerThread, reference: list, health: HealthLog, fault: str) -> None:
    restarts, resumed = metric(server, "mtpserve_worker_restarts_total"), metric(server, "mtpserve_requests_resumed_total")
    recoveries = metric(server, "mtpserve_recovery_seconds_count")
    outs = run_streams(server, FAULTS[fault](server))
    assert outs == reference  # greedy and seeded alike: the client saw a pause, not a difference
    assert metric(server, "mtpserve_worker_restarts_total") == restarts + 2  # the whole replica: both workers
    assert metric(server, "mtpserve_recovery_seconds_count") == recoveries + 1
    assert metric(server, "mtpserve_requests_resumed_total") > resumed  # the fault struck mid-stream
    assert health.went_down_and_up(), health.statuses
    assert engine_idle(server) == (True, 0)
    with Client(f"127.0.0.1:{server.port}", timeout=WAIT_S) as c:  # and it serves new requests
        assert c.generate(PROMPTS[0], PARAMS[0]).token_ids == reference[0][0]


def test_an_overlapped_replica_survives_a_lost_worker(partly_trained: Path, reference: list) -> None:
    """Steps overlapped on Ray (step n + 1 launched before step n's result is read, the default on CUDA):
    the worker dies with a step in flight and one held; the resumed streams still equal the reference. Warmed up
    (cluster/warmup.py), the replacement worker runs the warm-up again before it serves."""
    srv = start(partly_trained, use_ray=True, async_scheduling=True, max_faults=10, compile_warmup=True)
    try:
        outs = run_streams(srv, kill(srv, "target worker (rank 0)"))
        assert outs == reference
        assert srv.replica.engine_loop.call(lambda e: e.num_overlapped_steps).result(30) > 0
        warmed = srv.replica.engine_loop.call(lambda e: (e.num_warmup_steps, len(warmup.plans(e.resolved))))
        steps, per_start = warmed.result(30)
        assert steps == 2 * per_start > 0, "at start and after the recovery"
        assert metric(srv, "mtpserve_worker_restarts_total") == 1
        assert engine_idle(srv) == (True, 0)
    finally:
        srv.stop()


def test_a_full_queue_while_recovering_is_unavailable_with_a_retry_hint(server: ServerThread, health: HealthLog) -> None:
    """Requests that arrive during a recovery wait; once the queue is full they get UNAVAILABLE and a hint."""
    hang(server, 0)()  # the next step hangs: the step timeout notices, recovery follows
    full = ENGINE["max_num_seqs"]
    with ThreadPoolExecutor(full) as pool, grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        waiting = [pool.submit(lambda p=p: list(stub.Generate(build_request(p, {"max_tokens": 2, "temperature": 0}),
                                                               timeout=WAIT_S)))
                   for p in (PROMPTS * 3)[:full]]
        assert health.went_down()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(build_request([5], {"max_tokens": 2}), timeout=WAIT_S))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "recovers" in err.value.details() and "retry" in err.value.details()
        assert (RETRY_METADATA_KEY, "5000") in [(m.key, m.value) for m in err.value.trailing_metadata()]
        for done in waiting:  # the requests that waited complete once the workers are back
            assert done.result(WAIT_S)[-1].complete.finish_reason == "length"
    assert health.went_down_and_up()
    assert engine_idle(server) == (True, 0)


def test_three_faults_exhaust_the_budget(partly_trained: Path, local_ray: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every incarnation of the target dies at its first step: the third fault ends the replica."""
    monkeypatch.setenv(FAULT_ENV, "target:0:step")
    srv = start(partly_trained, use_ray=True)  # default budget: 3 faults in 10 minutes
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            calls = [stub.Generate(build_request(p, {"max_tokens": 8, "temperature": 0}), timeout=WAIT_S)
                     for p in PROMPTS[:3]]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    list(call)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "after 3 worker faults" in err.value.details()
                assert "target worker (rank 0)" in err.value.details()  # the cause, named
            with pytest.raises(grpc.RpcError) as err:  # later requests are refused at once, with the cause
                list(stub.Generate(build_request([5], {"max_tokens": 2}), timeout=WAIT_S))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "worker faults" in err.value.details()
        with Client(f"127.0.0.1:{srv.port}", timeout=WAIT_S) as c:
            assert c.health() == "NOT_SERVING"
        assert not srv.healthy()  # what Ray Serve's check_health asks: a supervisor may now replace it
        assert engine_idle(srv) == (True, 0)
    finally:
        srv.stop()
