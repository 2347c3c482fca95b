"""One engine configuration, built once from the command line (or a test) and carried unchanged to
every worker: the layout, the cache, the scheduler, DSA, expert placement, profiling.

No torch here: the coordinator and the launch commands import it without the model.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, replace

from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.dsa_config import DSAConfig

BACKENDS = ("cpu", "hpu")  # the names dist_glm5.backends.get_backend knows


def parse_ctx(text: str) -> int:
    """A context length as the command lines take it (--ctx): tokens (131072) or thousands (128k,
    637k)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"context {text!r}: give tokens (131072) or thousands (128k, 637k)"
        )
    n = int(m.group(1)) * (1024 if m.group(2) else 1)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"context {text!r} must be positive")
    return n


@dataclass(frozen=True, order=True)
class StageId:
    """One worker of the pipeline: a stage and a rank inside it."""

    stage: int
    rank: int = 0

    def __str__(self) -> str:
        return f"stage {self.stage} rank {self.rank}"

    @property
    def identity(self) -> bytes:
        """The worker's zmq socket identity (the coordinator's ROUTER addresses it by this)."""
        return f"{self.stage}/{self.rank}".encode()


@dataclass(frozen=True)
class Layout:
    """Pipeline stages (one per node) x ranks per stage. Attention heads, the dense MLP and the
    shared expert split over the `tp` ranks; routed experts split by expert (`ep` == `tp`) or along
    their intermediate dim (`ep` 1)."""

    stages: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.tp < 1 or self.ep < 1:
            raise ValueError(
                f"--stages {self.stages} --tp {self.tp} --ep {self.ep}: each must be >= 1"
            )
        if self.ep not in (1, self.tp):
            raise ValueError(
                f"--ep {self.ep} with --tp {self.tp}: expert parallelism runs over the "
                f"tensor-parallel ranks of a stage; use --ep {self.tp} or --ep 1"
            )

    @property
    def ranks(self) -> int:
        return self.tp

    @property
    def workers(self) -> list[StageId]:
        return [StageId(s, r) for s in range(self.stages) for r in range(self.ranks)]


@dataclass(frozen=True)
class CacheConfig:
    blocks: int = 1024  # paged-cache blocks per worker
    block_size: int = 64  # tokens per block

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.block_size < 1:
            raise ValueError(
                f"cache of {self.blocks} blocks of {self.block_size} tokens: both must be >= 1"
            )

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    layout: Layout = field(default_factory=Layout)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dsa: DSAConfig = field(default_factory=DSAConfig)
    mtp: bool = False  # one MTP draft per step, verified on the last stage
    dtype: str | None = None  # compute dtype; None: the checkpoint's
    threads: int | None = None  # torch CPU threads per worker
    placement: dict | None = None  # per MoE layer, the checkpoint expert at each position
    profile: bool = False  # record profiler spans and send them with every step
    address: str | None = None  # an existing Ray cluster; None: in process, or a local cluster
    host: str = "127.0.0.1"  # the address our sockets bind and advertise
    backend: str = "cpu"  # dist_glm5.backends: where every worker places and runs its stage
    # Failure detection (Ray pipelines). A worker's heartbeat thread beats while its main thread
    # computes, so a long prefill chunk is never taken for a frozen worker: the heartbeat timeout
    # finds a stopped or unreachable one in seconds; the step timeout is the backstop for a live
    # worker that makes no progress (gloo's own timeout is set above it, so we name the stage).
    step_timeout: float = 300.0  # s for a step's result; then the earliest stage not done fails
    heartbeat_interval: float = 1.0  # s between a worker's heartbeats
    heartbeat_timeout: float = 10.0  # s of silence after which a worker is failed as frozen
    # s for a (re)start: placement, workers up, weights loaded; a restart attempt that cannot
    # (a node gone with the link to it) fails after this and the next attempt tries again
    startup_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval * 2 <= self.heartbeat_timeout:
            raise ValueError(
                f"--heartbeat-timeout {self.heartbeat_timeout} must be at least twice "
                f"--heartbeat-interval {self.heartbeat_interval} (and both > 0)"
            )
        if self.startup_timeout <= 0:
            raise ValueError(f"--startup-timeout {self.startup_timeout}: must be > 0")
        if self.step_timeout <= 0:
            raise ValueError(f"--step-timeout {self.step_timeout}: must be > 0")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"backend {self.backend!r}: choose one of {', '.join(BACKENDS)} (--backend)"
            )
        if self.scheduler.mtp != self.mtp:  # one source of truth: the engine's flag
            object.__setattr__(self, "scheduler", replace(self.scheduler, mtp=self.mtp))
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"dtype {self.dtype!r}: use float32 or bfloat16 (or none: the checkpoint's)"
            )

    @property
    def in_process(self) -> bool:
        """One worker and no cluster named: run it in this process, without Ray."""
        return len(self.layout.workers) == 1 and not self.address


@dataclass(frozen=True)
class StageSpec:
    """What one worker is told: the engine configuration, which worker it is, which layers it
    owns."""

    engine: EngineConfig
    id: StageId = StageId(0, 0)
    layers: tuple[int, int] | None = None  # [start, stop); None: every layer (one stage)

    @property
    def stage(self) -> int:
        return self.id.stage

    @property
    def rank(self) -> int:
        return self.id.rank

    @property
    def stages(self) -> int:
        return self.engine.layout.stages

    @property
    def ranks(self) -> int:
        return self.engine.layout.ranks
