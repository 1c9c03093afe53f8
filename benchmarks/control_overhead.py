"""Control overhead per step of the Ray executor: the plan out to every worker, the result back.

A null step (an empty plan: every worker applies it and target rank 0 answers at once) measures the
channel alone; for scale it also times a Ray actor call round trip and the pickling of a realistic
decode plan (64 requests, 4 drafts each, a new block for a quarter of them). docs/design.md §2 budgets
100 us per step for the control path on one node.

    python benchmarks/control_overhead.py [--tp 2] [--drafters 2] [--steps 3000]
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import tempfile
import time

import numpy as np
import ray
import torch

from mtpserve.boundary.channel import Listener
from mtpserve.cluster.engine_config import EngineConfig, ResolvedConfig
from mtpserve.cluster.ray_executor import RayExecutor
from mtpserve.boundary.messages import StepPlan
from mtpserve.workers.models.train import build_models, tiny_config
from mtpserve.workers.models.writer import save_checkpoint


def percentiles(seconds: list[float]) -> str:
    us = np.array(seconds) * 1e6
    return f"p50 {np.percentile(us, 50):7.1f} us   p99 {np.percentile(us, 99):7.1f} us   mean {us.mean():7.1f} us"


def timed(fn, steps: int, warmup: int = 200) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def decode_plan(num_reqs: int = 64, drafts: int = 4) -> StepPlan:
    ids = [f"req-{i:06d}" for i in range(num_reqs)]
    blocks = [[[1000 + i] if i % 4 == 0 else [] for _ in range(4)] for i in range(num_reqs)]
    return StepPlan([], ids, [1] * num_reqs, [drafts] * num_reqs, blocks, [])


_ECHO = """
import sys
from mtpserve.boundary.channel import Channel
ch = Channel.connect(("127.0.0.1", int(sys.argv[1])), timeout=30, token=bytes.fromhex(sys.argv[2]))
ch.send(("hello", 0))
while True:
    msg = ch.recv()
    if msg is None:
        break
    ch.send(msg)
"""


def socket_floor(steps: int) -> list[float]:
    """The same framed-pickle channel between two plain processes: the floor under the executor's figure."""
    listener = Listener()
    child = subprocess.Popen([sys.executable, "-c", _ECHO, str(listener.port), listener.token.hex()])
    ch = listener.accept(1, time.monotonic() + 60)[0]
    try:
        return timed(lambda: (ch.send(("plan", None)), ch.recv()), steps)
    finally:
        ch.send(None)
        child.wait(timeout=30)
        listener.close()


@ray.remote(num_cpus=0)
class Echo:
    def ping(self, x: object) -> object:
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--drafters", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    ray.init(num_cpus=args.tp + args.drafters + 1, include_dashboard=False, log_to_driver=False)  # logical CPUs
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(vocab_size=64, num_mtp=3)
        _, target, mtp = build_models(cfg)
        save_checkpoint(tmp, cfg, target, mtp, dtype=torch.float32)
        resolved = ResolvedConfig.resolve(EngineConfig(model=tmp, tensor_parallel_size=args.tp,
                                                       drafter_devices=args.drafters, num_kv_blocks=64, use_ray=True))
        executor = RayExecutor(resolved)
        try:
            null = timed(lambda: executor.execute(StepPlan()), args.steps)
        finally:
            executor.shutdown()
    floor = socket_floor(args.steps)
    plan = decode_plan()
    data = pickle.dumps(("plan", plan), protocol=pickle.HIGHEST_PROTOCOL)
    dumps = timed(lambda: pickle.dumps(("plan", plan), protocol=pickle.HIGHEST_PROTOCOL), args.steps)
    loads = timed(lambda: pickle.loads(data), args.steps)
    echo = Echo.remote()
    ray.get(echo.ping.remote(None))
    ray_rtt = timed(lambda: ray.get(echo.ping.remote(None)), min(args.steps, 1000), warmup=50)
    ray.shutdown()
    print(f"workers: tp={args.tp} + drafters={args.drafters}  ({args.steps} steps, CPU, gloo)")
    print(f"null step, plan out to {args.tp + args.drafters} workers + result back: {percentiles(null)}")
    print(f"floor: same channel, one plain process echoing:     {percentiles(floor)}")
    print(f"pickle a 64-request decode plan ({len(data)} bytes):  dumps {percentiles(dumps)}")
    print(f"                                                 loads {percentiles(loads)}")
    print(f"Ray actor call round trip, for comparison:          {percentiles(ray_rtt)}")


if __name__ == "__main__":
    main()
