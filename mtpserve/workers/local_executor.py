"""The in-process executor: one ModelRunner in the engine's own process (tp = 1, drafter colocated)."""

from __future__ import annotations

from mtpserve.boundary.messages import StepPlan, StepResult
from mtpserve.workers.model_runner import ModelRunner, PendingStep, RunnerConfig
from mtpserve.workers.models.loader import ModelSource, load_model


class LocalExecutor:
    def __init__(self, source: ModelSource, config: RunnerConfig) -> None:
        model = load_model(source.path, source.dtype, source.device)
        self.runner = ModelRunner(model, config, source.dtype, source.device)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def submit(self, plan: StepPlan) -> PendingStep | StepResult:
        return self.runner.submit(plan)

    def wait(self, handle: PendingStep | StepResult) -> StepResult:
        return self.runner.wait(handle)

    def shutdown(self) -> None:
        pass
