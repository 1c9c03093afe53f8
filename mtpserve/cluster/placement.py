"""Placement of one replica on a Ray cluster.

Two placement groups per replica: the target's tensor-parallel ranks in one STRICT_PACK group (they
all-reduce every layer, so they must share a node and its NVLink), and the drafter group in its own
STRICT_PACK group, which Ray may put on another node (it exchanges a few tensors per step with target
rank 0). One bundle per worker: {"GPU": 1, "CPU": 1} on CUDA, {"CPU": 1} on CPU, plus any custom
resources the configuration names to pin a group to particular nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from mtpserve.errors import DeploymentError


@dataclass
class GroupRequest:
    role: str  # "target" or "drafter", for messages
    size: int
    use_gpu: bool
    extra: dict[str, float] = field(default_factory=dict)
    strategy: str = "STRICT_PACK"

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": 1.0, **({"GPU": 1.0} if self.use_gpu else {}), **self.extra}

    def describe(self) -> str:
        return f"{self.size} x {self.bundle} on one node ({self.strategy}) for the {self.role} group"


def reserve(requests: list[GroupRequest], timeout_s: float) -> list[PlacementGroup]:
    """Create the groups and wait until all are placed; on timeout remove them and name what is missing."""
    groups = [placement_group([req.bundle] * req.size, strategy=req.strategy) for req in requests]
    refs = [g.ready() for g in groups]
    ready, _ = ray.wait(refs, num_returns=len(groups), timeout=timeout_s)
    if len(ready) == len(groups):
        return groups
    missing = [req.describe() for req, ref in zip(requests, refs) if ref not in ready]
    release(groups)
    raise DeploymentError(
        f"placement timed out after {timeout_s:g} s: the cluster cannot provide {'; '.join(missing)}. "
        f"Nodes: {_nodes()}"
    )


def release(groups: list[PlacementGroup]) -> None:
    for g in groups:
        try:
            remove_placement_group(g)
        except Exception:  # already removed, or Ray is shutting down: nothing left to free
            pass


def _nodes() -> str:
    """Each alive node's total resources, for the error message (custom resources included)."""
    parts = []
    for node in ray.nodes():
        if node.get("Alive"):
            res = {k: v for k, v in node.get("Resources", {}).items()
                   if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type"))}
            parts.append(f"{node.get('NodeManagerAddress')} {res}")
    return "; ".join(parts) or "none alive"
