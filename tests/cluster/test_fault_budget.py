"""The fault budget of a replica (mtpserve/cluster/recovery.py): the max_faults-th fault within the window
ends the replica; older faults leave the window."""

from __future__ import annotations

from mtpserve.cluster.recovery import FaultBudget


def test_third_fault_within_the_window_is_refused() -> None:
    now = [0.0]
    budget = FaultBudget(3, 600.0, clock=lambda: now[0])
    assert budget.spend() and budget.spend()
    now[0] = 599.0
    assert not budget.spend()


def test_faults_leave_the_window() -> None:
    now = [0.0]
    budget = FaultBudget(3, 600.0, clock=lambda: now[0])
    assert budget.spend() and budget.spend()
    now[0] = 600.0  # both earlier faults are now 600 s old: out of the window
    assert budget.spend() and budget.spend()
    assert not budget.spend()


def test_a_budget_of_one_fails_at_the_first_fault() -> None:
    assert not FaultBudget(1, 600.0).spend()
