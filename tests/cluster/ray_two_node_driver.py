"""Driver of the two-node test, run as its own process (python -m tests.cluster.ray_two_node_driver).

A fresh process connects to the test's cluster with the same Ray authentication mode as the cluster,
whatever earlier tests in the pytest process did to Ray's process-wide state. It serves the shared
request set with the target group pinned to node_a and three drafters pinned to node_b, and writes
the outputs and where each worker ran as JSON.
"""

from __future__ import annotations

import json
import sys

import ray

from tests.cluster.ray_helpers import generate


def main(address: str, checkpoint: str, out_file: str) -> None:
    ray.init(address=address, log_to_driver=False)
    resources = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
    outs, llm = generate(checkpoint, drafter_devices=3, ray_address=address,
                         target_resources={"node_a": 1}, drafter_resources={"node_b": 1})
    try:
        placed = {name: resources[node] for name, node in llm.engine.executor.worker_nodes.items()}
        outputs = [{"token_ids": o.token_ids, "accepted": o.accepted_per_step, "logprobs": o.logprobs is not None}
                   for o in outs]
    finally:
        llm.shutdown()
        ray.shutdown()
    with open(out_file, "w") as f:
        json.dump({"placed": placed, "outputs": outputs}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
