"""Ray Serve for real (docs/design.md §7): the RayService deployment (RayServeReplica) run with `serve.run` on a
local Ray cluster, two replicas; gRPC and the OpenAI HTTP API reach both; one replica's process is killed,
the other keeps serving, and Serve starts a replacement that serves too."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import openai
import pytest
import ray
import yaml

from mtpserve.cluster.client import Client
from mtpserve.cluster.serve import ray_serve_deployment
from tests.checkpoints import write_tokenizer
from tests.cluster.ray_helpers import start_local_ray, stop_serve_router_loop

pytestmark = pytest.mark.slow
DEADLINE_S = 90.0  # replicas load a tiny model: seconds each, even on a busy 2-core machine


@pytest.fixture(scope="module")
def serve_app(trained_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ray import serve

    path = tmp_path_factory.mktemp("serve") / "tiny-mtp"
    shutil.copytree(trained_ckpt, path)
    write_tokenizer(path, 64)
    config = path.parent / "replica.yaml"
    config.write_text(yaml.safe_dump({"model": str(path), "num_kv_blocks": 128, "max_num_seqs": 8,
                                      "host": "127.0.0.1", "port": 0, "http_port": 0, "metrics_port": -1}))
    start_local_ray(num_cpus=4)
    try:
        serve.start(proxy_location="Disabled")  # requests go to the replicas' own ports, not Serve's proxy
        deployment = ray_serve_deployment().options(num_replicas=2, health_check_period_s=1,
                                                    ray_actor_options={"num_cpus": 0.5})
        yield serve.run(deployment.bind(config=str(config)), name="mtpserve", route_prefix=None)
    finally:
        serve.shutdown()
        stop_serve_router_loop()
        ray.shutdown()


def until(condition: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    """Poll `condition` until it returns something truthy (errors count as not yet)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            value = condition()
        except Exception:  # a replica that just died or is still starting
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


def replicas(handle: Any, calls: int = 16) -> dict[int, dict[str, int]]:
    """The replicas that answered some of `calls` concurrent endpoints() calls, by process id."""
    answers = [handle.endpoints.remote() for _ in range(calls)]
    found = {}
    for answer in answers:
        try:
            ep = answer.result(timeout_s=30)
            found[ep["pid"]] = ep
        except Exception:  # a call routed to a replica that died: Serve retries elsewhere next time
            pass
    return found


def two_replicas(handle: Any, excluding: int | None = None) -> dict[int, dict[str, int]]:
    def found() -> dict[int, dict[str, int]] | None:
        r = replicas(handle)
        return r if len(r) == 2 and excluding not in r else None
    return until(found, "two live replicas")


def check_serves(ep: dict[str, int]) -> None:
    with Client(f"127.0.0.1:{ep['grpc_port']}", timeout=60) as c:
        assert len(c.generate([5, 6], {"max_tokens": 4, "ignore_eos": True}).token_ids) == 4
    with openai.OpenAI(base_url=f"http://127.0.0.1:{ep['http_port']}/v1", api_key="x", max_retries=0,
                       timeout=60) as c:
        out = c.completions.create(model="tiny-mtp", prompt="w5 w6", max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.choices[0].text


def test_two_replicas_serve_and_one_is_replaced(serve_app: Any) -> None:
    first = two_replicas(serve_app)
    for ep in first.values():
        check_serves(ep)
    victim, survivor = sorted(first)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{first[survivor]['http_port']}/v1", api_key="x",
                       max_retries=0, timeout=60) as c:
        stream = c.completions.create(model="tiny-mtp", prompt=[7, 8], max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices[0].text
        os.kill(victim, signal.SIGKILL)
        check_serves(first[survivor])  # while Serve notices and replaces the dead one
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"  # the survivor's stream ran to its end
    second = two_replicas(serve_app, excluding=victim)
    assert survivor in second, "the surviving replica kept its process"
    (replacement,) = set(second) - {survivor}
    check_serves(second[replacement])
