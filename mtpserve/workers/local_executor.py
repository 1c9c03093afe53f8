"""The in-process executor: one ModelRunner in the engine's own process (tp = 1, drafter colocated)."""

from __future__ import annotations

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.model_runner import ModelRunner, PendingStep, RunnerConfig
from mtpserve.workers.graph_timing import time_start_graphs
from mtpserve.workers.models.loader import ModelSource, load_model


class LocalExecutor:
    def __init__(self, source: ModelSource, config: RunnerConfig) -> None:
        model = load_model(source.path, source.dtype, source.device)
        self.runner = ModelRunner(model, config, source.dtype, source.device)
        # (batch bucket, k, greedy, seconds) of the graphs captured at start: adaptive speculation's first step
        # costs.
        uniform = self.runner.uniform
        self.start_step_costs = time_start_graphs(uniform) if uniform is not None and uniform.use_graphs else []

    can_overlap = True  # the engine may launch step n + 1 before it reads step n

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def submit(self, plan: StepPlan) -> PendingStep | StepResult:
        return self.runner.submit(plan)

    def wait(self, handle: PendingStep | StepResult) -> StepResult:
        return self.runner.wait(handle)

    @property
    def num_captures(self) -> int:
        """CUDA-graph captures so far (the engine's step costs leave out a step whose time held one)."""
        return self.runner.num_captures

    def shutdown(self) -> None:
        pass
