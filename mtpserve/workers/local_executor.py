"""The in-process executor: one ModelRunner in the engine's own process (tp = 1, drafter colocated)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtpserve.cluster.types import StepPlan, StepResult
from mtpserve.workers.model_runner import ModelRunner, PendingStep, RunnerConfig
from mtpserve.workers.models.loader import load_model

if TYPE_CHECKING:
    from mtpserve.cluster.engine_config import ResolvedConfig


def runner_config(r: "ResolvedConfig") -> RunnerConfig:
    c = r.config
    # Graphs only without tensor parallelism: its all-reduces inside the forward are not captured.
    return RunnerConfig(r.num_blocks, c.block_size, c.max_num_seqs, r.num_mtp_modules, c.mtp_chain, c.draft_top_m,
                        cuda_graphs=c.cuda_graphs and c.tensor_parallel_size == 1, max_model_len=r.max_model_len,
                        uniform_steps=c.uniform_steps)


class LocalExecutor:
    def __init__(self, resolved: "ResolvedConfig") -> None:
        model = load_model(resolved.model_path, resolved.dtype, resolved.device)
        self.runner = ModelRunner(model, runner_config(resolved), resolved.dtype, resolved.device)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def submit(self, plan: StepPlan) -> PendingStep | StepResult:
        return self.runner.submit(plan)

    def wait(self, handle: PendingStep | StepResult) -> StepResult:
        return self.runner.wait(handle)

    def shutdown(self) -> None:
        pass
