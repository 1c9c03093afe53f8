"""The Ray actors of a replica: target tensor-parallel ranks and drafter-group ranks.

Thin on purpose: Ray constructs a Worker, `start` joins the replica's torch.distributed group, loads
(and shards) the model and connects to the driver's control channel; `serve` then runs the step loop
until told to stop. No per-step traffic goes through Ray (docs/design.md §2).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from mtpserve.boundary.channel import Channel, ChannelClosed
from mtpserve.boundary.messages import StepPlan
from mtpserve.errors import CheckpointError
from mtpserve.workers.heap import freeze_startup_heap
from mtpserve.workers.drafter_group import DrafterRunner, TargetDraftLink
from mtpserve.workers.group_links import Topology
from mtpserve.workers.model_runner import ModelRunner, RunnerConfig
from mtpserve.workers.models.loader import CheckpointLoader, ModelSource, load_model
from mtpserve.workers.tensor_parallel import TPGroup, shard_model

T = TypeVar("T")

# Test-only fault injection: "<role>:<rank>:<point>" makes that worker's process exit at that point
# ("init", "load", or "step": its first step with requests, in every incarnation of that rank). A worker
# also takes ("fault", "exit" | "hang") on its control channel (RayExecutor.inject_fault, tests only).
FAULT_ENV = "MTPSERVE_TEST_FAULT"
# Seconds: a worker whose handling of one driver message takes longer prints every thread's stack to stderr
# (its Ray log), to find where a hung step waits. Unset or 0: off.
HANG_DUMP_ENV = "MTPSERVE_HANG_DUMP_S"


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "target" or "drafter"
    rank: int  # global rank in the replica's process group (targets first, then drafters)
    tp: int
    drafters: int  # G; 0 = the drafter runs inside the target ranks
    model: ModelSource
    runner: RunnerConfig
    timeout_s: float  # for the rendezvous and every collective

    @property
    def name(self) -> str:
        return f"{self.role} worker (rank {self.rank})"


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.runner: ModelRunner | DrafterRunner | None = None
        self.channel: Channel | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port for the process group's TCP store (asked of rank 0 only)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, master: tuple[str, int], driver: tuple[str, int], token: bytes) -> tuple[str, int]:
        """Join the group, load, connect to the driver; returns this worker's Ray node id and process id."""
        import ray

        spec, device = self.spec, _device(self.spec.model.device)
        _maybe_fault(spec, "init")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=spec.rank, world_size=spec.tp + spec.drafters,
                                timeout=timedelta(seconds=spec.timeout_s))
        tp_group = dist.new_group(list(range(spec.tp)))  # every rank takes part in creating every group
        _maybe_fault(spec, "load")
        self.runner = _build_target(spec, device, tp_group) if spec.role == "target" else _build_drafter(spec, device)
        self.channel = Channel.connect(driver, timeout=spec.timeout_s, token=token)
        self.channel.send(("hello", spec.rank))
        freeze_startup_heap()  # this process now only serves: its start-up heap need never be walked again
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def serve(self) -> None:
        """The step loop: every worker applies every plan; target rank 0 answers.

        A plan sent as "launch" (the driver overlaps steps, docs/design.md §8) is held: its result goes back
        once the next plan is launched behind it, or when the driver asks for it ("flush"), so the device
        runs step n + 1 while the driver reads step n. A "plan" is answered as soon as it has run."""
        runner, ch = self.runner, self.channel
        doomed = _fault_wanted(self.spec, "step")
        if self.spec.rank == 0 and hasattr(runner, "on_capture"):
            runner.on_capture(lambda: ch.send(("busy", "capturing a CUDA graph")))
        held = None  # a launched step whose result has not been sent
        dump_after = float(os.environ.get(HANG_DUMP_ENV) or 0)
        try:
            while True:
                if dump_after > 0:  # waiting for the driver is no hang
                    faulthandler.cancel_dump_traceback_later()
                kind, plan = ch.recv()
                if dump_after > 0:  # every thread's stack to stderr (the worker's log) if this message hangs
                    faulthandler.dump_traceback_later(dump_after, exit=False)
                if kind == "stop":
                    return
                if kind == "flush":
                    if held is not None:
                        self._answer(held, took_drafts=True)
                    held = None
                    continue
                if kind == "fault":
                    _inject(plan)
                    continue
                if kind == "counters":  # tests: which path this rank's steps took
                    ch.send(("counters", {"uniform_steps": runner.num_uniform_steps,
                                          "graph_replays": getattr(runner, "num_graph_replays", 0)}))
                    continue
                if doomed and plan.req_ids:
                    os._exit(17)
                held = self._run(plan, held, hold=kind == "launch")
        except ChannelClosed:
            return  # the driver went away: nothing left to serve
        except BaseException:
            try:
                ch.send(("error", self.spec.name, traceback.format_exc()))
            except OSError:
                pass
            raise
        finally:
            ch.close()

    def _run(self, plan: StepPlan, held: Any, hold: bool) -> Any:
        """Run a plan; answer the step held before it once this one is queued behind it. Returns the step now
        held: this one when `hold`, else None (answered at once)."""
        if hold:
            step = self.runner.submit(plan)
            # The drafter group's drafts for this step (queued on the device: no wait on CUDA) come in before
            # any step behind it is launched, which verifies them.
            self.runner.finish_step()
        else:
            step = self.runner.execute(plan)
        if held is not None:
            self._answer(held, took_drafts=True)
        if hold:
            return step
        self._answer(step, took_drafts=False)
        return None

    def _answer(self, step: Any, took_drafts: bool) -> None:
        """Read a step's result (waiting for the device where it is still running) and send it from rank 0;
        then, unless already done at its launch, take in the drafts the drafter group sampled."""
        result = self.runner.wait(step) if hasattr(self.runner, "wait") else step
        if self.spec.rank == 0:
            self.channel.send(("result", result))
        if not took_drafts:
            self.runner.finish_step()


def _device(configured: torch.device) -> torch.device:
    if configured.type != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
    return torch.device("cuda", 0)


def _fault_wanted(spec: WorkerSpec, point: str) -> bool:
    return os.environ.get(FAULT_ENV) == f"{spec.role}:{spec.rank}:{point}"


def _maybe_fault(spec: WorkerSpec, point: str) -> None:
    if _fault_wanted(spec, point):
        os._exit(17)


def _inject(kind: str) -> None:
    """Test hook: die now, or hang (the step never finishes) until the executor replaces this process."""
    if kind == "exit":
        os._exit(17)
    if kind == "hang":
        threading.Event().wait()
    raise ValueError(f"unknown fault {kind!r}")


def _topology(spec: WorkerSpec) -> Topology:
    return Topology(spec.tp, spec.drafters, spec.runner.num_mtp_modules, spec.runner.chain_mode)


def _build_target(spec: WorkerSpec, device: torch.device, tp_group: dist.ProcessGroup) -> ModelRunner:
    r, colocated = spec.model, spec.drafters == 0
    if spec.tp == 1:
        keep = None if colocated else (lambda name: not name.startswith("mtp."))
        model = _loading(spec, lambda: load_model(r.path, r.dtype, device, keep))
    else:
        # One part at a time: load it on the host, shard it, move the shard to the device.
        loader = _loading(spec, lambda: CheckpointLoader(r.path, r.dtype, device))
        model = loader.model

        def fetch(prefix: str) -> None:
            _loading(spec, lambda: loader.load(lambda name: name.startswith(prefix), "cpu"))

        shard_model(model.target, model.mtp if colocated else None, TPGroup(spec.rank, spec.tp, tp_group),
                    fetch, device)
    remote = None if colocated else TargetDraftLink(_topology(spec), spec.rank, spec.runner.draft_top_m, device)
    return ModelRunner(model, spec.runner, r.dtype, device, remote)


def _loading(spec: WorkerSpec, load: Callable[[], T]) -> T:
    """Run a load step; a failure reading the files becomes a checkpoint error naming the path."""
    try:
        return load()
    except CheckpointError:
        raise
    except Exception as e:  # e.g. a truncated safetensors file: the reader's own error type
        raise CheckpointError(f"cannot load the checkpoint at {spec.model.path}: "
                              f"{type(e).__name__}: {e}") from e


def _build_drafter(spec: WorkerSpec, device: torch.device) -> DrafterRunner:
    topo, r = _topology(spec), spec.model
    mine = tuple(f"mtp.{m}." for m in range(topo.num_modules) if topo.owner(m) == spec.rank)

    def keep(name: str) -> bool:  # the shared embedding and head, and this rank's modules only
        return name.startswith(("embed_tokens.", "lm_head.") + mine)

    model = _loading(spec, lambda: load_model(r.path, r.dtype, device, keep))
    return DrafterRunner(model, spec.runner, topo, spec.rank, r.dtype, device)
