"""Recovery of a replica from the loss of a worker (docs/design.md §2, Ray deployments).

The executor raises WorkerLost when a worker dies, closes its channel, fails or hangs during a step.
The engine then requeues every running request with the tokens it has already produced (the
scheduler's preemption path recomputes its KV; see Scheduler._preempt for why seeded sampling is not
disturbed), asks the executor to replace its workers, and steps on. A FaultBudget bounds this: the
`max_faults`-th fault within `window_s` (a failed replacement counts as one) fails the replica with
ReplicaFailed, naming the last cause.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from mtpserve.errors import DeploymentError, ReplicaFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryEvent:
    """One recovered fault, for the metrics."""

    cause: str
    seconds: float  # from noticing the fault to the new workers being ready
    workers_restarted: int
    requests_resumed: int


class Recoverable(Protocol):
    """An executor that can replace its workers (RayExecutor)."""

    num_workers: int

    def recover(self) -> None: ...


class FaultBudget:
    """Faults allowed within a sliding window of time."""

    def __init__(self, max_faults: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_faults, self.window_s, self._clock = max_faults, window_s, clock
        self._times: deque[float] = deque()

    def spend(self) -> bool:
        """Record a fault; False once it is the max_faults-th within the window."""
        now = self._clock()
        self._times.append(now)
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times) < self.max_faults


def recover(executor: Recoverable, requeue: Callable[[], int], budget: FaultBudget, cause: str,
            on_serving: Callable[[bool], None] | None) -> RecoveryEvent:
    """Replace the executor's workers until it works or the budget is spent (then ReplicaFailed).

    `requeue` puts the running requests back in the queue and returns how many; `on_serving(False)`
    is called before and `on_serving(True)` after a successful recovery.
    """
    t0 = time.monotonic()
    if on_serving is not None:
        on_serving(False)
    resumed = requeue()
    while True:
        if not budget.spend():
            raise ReplicaFailed(f"the replica failed after {budget.max_faults} worker faults within "
                                f"{budget.window_s:g} s; the last: {cause}")
        log.warning("worker fault (%s): replacing the workers, %d requests resume", cause, resumed)
        try:
            executor.recover()
            break
        except DeploymentError as e:
            cause = f"recovery failed: {e}"
    seconds = time.monotonic() - t0
    log.warning("recovered in %.1f s", seconds)
    if on_serving is not None:
        on_serving(True)
    return RecoveryEvent(cause, seconds, executor.num_workers, resumed)
