"""What the coordinator drives: a pipeline of stage workers that takes plans and returns results,
in this process (`InProcessPipeline`) or as Ray actors (`ray_pipeline.RayPipeline`)."""

from __future__ import annotations

from typing import Protocol

from dist_glm5.engine.config import CacheConfig
from dist_glm5.engine.messages import StepPlan, StepResult


class StageFailure(RuntimeError):
    def __init__(self, stage: int, rank: int, error: str):
        super().__init__(
            f"stage {stage} rank {rank} failed: "
            f"{error.strip().splitlines()[0] if error.strip() else error}"
        )
        self.stage, self.rank, self.detail = stage, rank, error


class Pipeline(Protocol):
    """send() and recv() raise StageFailure naming the stage and rank that failed.

    A pipeline of processes may also watch its workers between steps: `poll()` (called while
    idle; raises StageFailure like recv()) and `stalled` (a worker is late: what it is, else None).
    """

    @property
    def cache(self) -> CacheConfig: ...  # every worker's cache: the scheduler's ledger mirrors it
    def send(self, plan: StepPlan) -> None: ...
    def recv(self, timeout: float) -> StepResult: ...
    def restart(self) -> None: ...
    def close(self) -> None: ...
