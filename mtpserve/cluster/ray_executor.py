"""Runs a replica's steps on Ray actors: `tensor_parallel_size` target ranks and `drafter_devices` drafters.

Ray places, starts and monitors the workers and carries their addresses once; every step then goes
out over persistent sockets (mtpserve/boundary/channel.py) and tensors move over torch.distributed
(NCCL on CUDA, gloo on CPU). Start-up is bounded everywhere: placement, every worker's load and the
channel handshake each have a deadline, and the first worker to fail ends the start with its cause.

A worker lost during a step (its process died, it closed its channel, it failed, or the step ran past
the step timeout) raises WorkerLost; `recover` then replaces every worker in the same placement groups
(new groups if those cannot be placed again: their node is gone). All of them, because the survivors'
torch.distributed group includes the dead rank and may be stuck in a collective with it.
"""

from __future__ import annotations

import os
import pickle
import select
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mtpserve.cluster import placement
from mtpserve.boundary.channel import Channel, ChannelClosed, Listener
from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.errors import DeploymentError, WorkerLost
from mtpserve.workers.tensor_parallel import check_shardable
from mtpserve.workers.worker import Worker, WorkerSpec

if TYPE_CHECKING:
    from mtpserve.cluster.engine_config import ResolvedConfig

_STOP_GRACE_S = 5.0
_POLL_S = 0.5  # while a step runs: how often to look for dead workers and the step timeout


class RayExecutor:
    def __init__(self, resolved: "ResolvedConfig") -> None:
        c = resolved.config
        check_shardable(resolved.model_config, c.tensor_parallel_size)
        if c.drafter_devices > resolved.num_mtp_modules:
            raise ValueError(f"drafter_devices: {c.drafter_devices} devices for {resolved.num_mtp_modules} MTP "
                             f"module(s) in use (mtp_chain={c.mtp_chain!r}); each device holds at least one module")
        self.tp, self.drafters = c.tensor_parallel_size, c.drafter_devices
        self.num_workers = self.tp + self.drafters
        self.worker_nodes: dict[str, str] = {}  # worker name -> Ray node id
        self.worker_pids: dict[str, int] = {}  # worker name -> process id (tests kill workers by it)
        self._resolved = resolved
        self._slowest_step = 0.0  # seconds, over every incarnation of the workers
        self._warm = False  # this incarnation of the workers finished a step (its first compiles kernels)
        self.compiling = False  # steps sent meanwhile may compile (the engine's warm-up): the start-up timeout
        self._groups: list = []
        self._actors: list[Any] = []
        self._names: list[str] = []
        self._serve_refs: list[ray.ObjectRef] = []
        self._channels: list[Channel] = []
        self._listener: Listener | None = None
        self._failed: str | None = None
        self._started_ray = False
        self._launched = 0  # steps launched with `submit`
        self._held = -1  # the one of them the workers hold unanswered (-1: none)
        try:
            self._start(resolved)
        except BaseException:
            self.shutdown()
            raise

    # -- start-up -----------------------------------------------------------------------------------
    def _start(self, r: "ResolvedConfig") -> None:
        c = r.config
        if not ray.is_initialized():
            ray.init(address=c.ray_address, log_to_driver=True)
            self._started_ray = True
        self._reserve(r)
        self._launch(r)

    def _reserve(self, r: "ResolvedConfig") -> None:
        c, use_gpu = r.config, r.device.type == "cuda"
        requests = [placement.GroupRequest("target", self.tp, use_gpu, dict(c.target_resources or {}))]
        if self.drafters:
            requests.append(placement.GroupRequest("drafter", self.drafters, use_gpu, dict(c.drafter_resources or {})))
        self._groups = placement.reserve(requests, c.placement_timeout_s)

    def _launch(self, r: "ResolvedConfig") -> None:
        """Start the workers in the reserved groups, join them and open their channels."""
        c, use_gpu = r.config, r.device.type == "cuda"
        deadline = time.monotonic() + c.startup_timeout_s
        self._actors, self._names, self._warm = [], [], False
        self._listener = Listener()
        self._spawn(r, use_gpu)
        master = self._get(self._actors[0].rendezvous_address.remote(), deadline, self._names[0])
        driver = (ray.util.get_node_ip_address(), self._listener.port)
        token = self._listener.token
        starts = {a.start.remote(master, driver, token): name for a, name in zip(self._actors, self._names)}
        started = self._wait_all(starts, deadline, c.startup_timeout_s)
        self.worker_nodes = {name: node for name, (node, _) in started.items()}
        self.worker_pids = {name: pid for name, (_, pid) in started.items()}
        try:
            by_rank = self._listener.accept(len(self._actors), deadline)
        except TimeoutError as e:
            raise DeploymentError(f"workers did not connect to the control channel: {e}") from None
        self._channels = [by_rank[rank] for rank in range(len(self._actors))]
        self._by_fd = {ch.fileno(): (ch, name) for ch, name in zip(self._channels, self._names)}
        self._fds = list(self._by_fd)
        self._listener.close()  # nobody else may connect once every worker has
        self._listener = None
        self._serve_refs = [a.serve.remote() for a in self._actors]

    def _spawn(self, r: "ResolvedConfig", use_gpu: bool) -> None:
        env = {k: v for k, v in os.environ.items() if k.startswith("MTPSERVE_")}  # e.g. test fault injection
        roles = [("target", self._groups[0], i) for i in range(self.tp)]
        roles += [("drafter", self._groups[1], i) for i in range(self.drafters)]
        actor_cls = ray.remote(Worker)
        for rank, (role, group, bundle) in enumerate(roles):
            spec = WorkerSpec(role, rank, self.tp, self.drafters, r.model_source(), r.runner_config(),
                              r.config.startup_timeout_s)
            self._actors.append(actor_cls.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": env} if env else None,
            ).remote(spec))
            self._names.append(spec.name)

    def _get(self, ref: ray.ObjectRef, deadline: float, name: str) -> Any:
        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except GetTimeoutError:
            raise DeploymentError(f"{name} did not answer within the start-up timeout") from None
        except (RayActorError, RayTaskError) as e:
            raise DeploymentError(_failure(name, e, "during start-up")) from None

    def _wait_all(self, refs: dict[ray.ObjectRef, str], deadline: float, timeout_s: float) -> dict[str, Any]:
        """Wait for every worker's start; the first failure wins (the others are likely stuck waiting for it)."""
        pending, done = dict(refs), {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise DeploymentError(f"start-up timed out after {timeout_s:g} s waiting for "
                                      f"{', '.join(sorted(pending.values()))}")
            name = pending.pop(ready[0])
            done[name] = self._get(ready[0], deadline, name)
        return done

    # -- steps --------------------------------------------------------------------------------------
    can_overlap = True  # the engine may launch step n + 1 before it reads step n (async scheduling)

    def execute(self, plan: StepPlan) -> StepResult:
        self._send("plan", plan)
        return self._await_result()

    def submit(self, plan: StepPlan) -> "InFlight":
        """Launch a step; its result comes back once the next step is launched behind it, or on `wait`."""
        self._send("launch", plan)
        self._launched += 1
        self._held = self._launched
        return InFlight(self._launched)

    def wait(self, step: "InFlight") -> StepResult:
        if step.seq == self._held:  # nothing was launched behind it: ask for it
            self._send("flush", None)
            self._held = -1
        t0 = time.perf_counter()
        result = self._await_result()
        # The engine's step costs take the host's share as the lap less the time it sat blocked (design §9).
        result.blocked_seconds = time.perf_counter() - t0
        return result

    def _send(self, kind: str, plan: StepPlan | None) -> None:
        if self._failed:
            raise DeploymentError(f"the deployment has failed: {self._failed}")
        if not self._channels:
            raise DeploymentError("the executor has been shut down")
        data = pickle.dumps((kind, plan), protocol=pickle.HIGHEST_PROTOCOL)
        for ch, name in zip(self._channels, self._names):
            try:
                ch.send_bytes(data)
            except OSError as e:
                self._fail(f"{name} is unreachable ({e})")

    def _await_result(self) -> StepResult:
        by_fd, fds = self._by_fd, self._fds
        started = time.monotonic()
        # Until a step has completed, during the engine's warm-up and after a worker says it captures a graph,
        # the step may be compiling kernels: the startup timeout applies instead of the hang detector's.
        may_compile = not self._warm or self.compiling
        limit = self._resolved.config.startup_timeout_s if may_compile else self.step_timeout_s()
        while True:
            ready = select.select(fds, [], [], _POLL_S)[0]
            if not ready:
                self._check_alive()  # a hung collective looks like silence: see whether a worker is gone
                if time.monotonic() - started > limit:
                    self._fail(f"a step ran past the step timeout of {limit:.1f} s (the slowest before took "
                               f"{self._slowest_step:.2f} s): a worker hangs")
                continue
            for fd in ready:
                ch, name = by_fd[fd]
                try:
                    msg = ch.recv()
                except (ChannelClosed, OSError):
                    self._fail(f"{name} closed its control channel (its process died?){self._actor_cause(name)}")
                if msg[0] == "busy":
                    started, limit = time.monotonic(), max(limit, self._resolved.config.startup_timeout_s)
                    may_compile = True
                    continue
                if msg[0] == "result":
                    if not may_compile:  # a step that compiled says nothing of how long serving steps take
                        self._slowest_step = max(self._slowest_step, time.monotonic() - started)
                    # The warm-up's steps leave the first served step the start-up timeout: what the warm-up did
                    # not compile (a sampling feature, a tile it missed) it may still compile.
                    self._warm = self._warm or not self.compiling
                    return msg[1]
                if msg[0] == "error":
                    self._fail(f"{msg[1]} failed during a step:\n{msg[2]}")

    def step_timeout_s(self) -> float:
        """The configured step timeout, else the slowest step seen plus a margin (twice it for slow steps)."""
        c = self._resolved.config
        if c.step_timeout_s is not None:
            return c.step_timeout_s
        return c.step_timeout_margin_s + 2.0 * self._slowest_step

    def _check_alive(self) -> None:
        done, _ = ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=0)
        for ref in done:
            name = self._names[self._serve_refs.index(ref)]
            try:
                ray.get(ref)
                self._fail(f"{name} stopped serving")
            except (RayActorError, RayTaskError) as e:
                self._fail(_failure(name, e, "while serving"))

    def _actor_cause(self, name: str) -> str:
        ref = self._serve_refs[self._names.index(name)]
        try:
            ray.get(ref, timeout=2.0)
        except (RayActorError, RayTaskError) as e:
            return f": {_failure(name, e, 'while serving')}"
        except Exception:
            pass
        return ""

    def _fail(self, message: str) -> None:
        self._failed = message
        raise WorkerLost(message)

    # -- recovery -----------------------------------------------------------------------------------
    def recover(self) -> None:
        """Replace every worker (they load the weights again) and reconnect; raises DeploymentError
        naming the cause when that fails. The caller resubmits the requests (the new workers hold none)."""
        self._stop_workers(grace=False)
        try:
            if not all(_placed(g) for g in self._groups):  # a node is gone: reserve the bundles anew
                placement.release(self._groups)
                self._groups = []
                self._reserve(self._resolved)
            self._launch(self._resolved)
        except BaseException:
            self._stop_workers(grace=False)
            raise
        self._failed, self._held = None, -1  # the new workers hold nothing

    def inject_fault(self, rank: int, kind: str) -> None:
        """Test hook: the worker of this rank exits ("exit") or hangs ("hang") before its next step.
        Call it where steps are driven (the engine thread): the channel carries one message at a time."""
        self._channels[rank].send(("fault", kind))

    # -- shutdown -----------------------------------------------------------------------------------
    def _stop_workers(self, grace: bool) -> None:
        """Ask the workers to stop (with grace: wait for them a little), then end their processes."""
        for ch in self._channels:
            try:
                ch.send(("stop", None))
            except OSError:
                pass
        if self._serve_refs and grace:
            ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=_STOP_GRACE_S)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        for ch in self._channels:
            ch.close()
        if self._listener is not None:
            self._listener.close()
        self._actors, self._names, self._channels, self._serve_refs, self._listener = [], [], [], [], None
        self.worker_pids, self.worker_nodes = {}, {}

    def shutdown(self) -> None:
        self._stop_workers(grace=not self._failed)
        placement.release(self._groups)
        self._groups = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


@dataclass(frozen=True)
class InFlight:
    """A step launched on the workers whose result the engine has not read."""

    seq: int
    overlappable: bool = True  # the scheduler decides whether a step may follow it (schedule_overlapped)


def _placed(group: Any) -> bool:
    """Whether a placement group still holds all its bundles (Ray re-places those of a lost node)."""
    try:
        return placement_group_table(group).get("state") == "CREATED"
    except Exception:  # the group was removed, or the GCS cannot say
        return False


def _failure(name: str, e: Exception, when: str) -> str:
    """A worker's failure in one line naming the cause: its exception, or how its process died."""
    if isinstance(e, RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return f"{name} failed {when}: {type(cause).__name__}: {_first_line(cause)}"
    text, marker = str(e), "Worker exit detail: "
    detail = text[text.index(marker) + len(marker):].split(". ")[0] if marker in text else ""
    return f"{name} died {when}: {_first_line(e)}" + (f" ({detail})" if detail else "")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)
