"""One stage, one rank, in this process: no Ray, no sockets (tests, `launch generate` on one
worker)."""

from __future__ import annotations

from dist_glm5.engine.messages import StepPlan, StepResult
from dist_glm5.engine.pipeline import StageFailure

from .worker import StageWorker


class InProcessPipeline:
    """One stage, one rank, in this process: plans run as they are sent."""

    def __init__(self, spec, worker_cls=None):
        self.spec, self.worker_cls = spec, worker_cls or StageWorker
        self.worker = self.worker_cls(spec)
        self.results: list[StepResult] = []

    @property
    def cache(self):
        return self.spec.engine.cache

    def send(self, plan: StepPlan) -> None:
        try:
            self.results.append(self.worker.step(plan))
        except Exception as e:
            raise StageFailure(0, 0, f"{type(e).__name__}: {e}") from e

    def recv(self, timeout: float) -> StepResult:
        return self.results.pop(0)

    def restart(self) -> None:
        self.worker = self.worker_cls(self.spec)
        self.results = []

    def close(self) -> None:
        pass
