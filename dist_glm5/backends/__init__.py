"""The one backend boundary. `get_backend("cpu")` is the complete reference; `get_backend("hpu")`
imports the Gaudi stack (habana_frameworks) only when chosen, so nothing else ever imports it.

A backend names its device and collective backend and makes the hot ops (`dist_glm5.ops.Ops`)
the model is built with, and the stage runtime a worker runs its steps through (`stage`:
backends/stage.py's StageRuntime; the CPU's adds nothing to the model, the Gaudi one places,
pads and warms up). A backend other than the CPU reference may also bring its own communicator
(`comm`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from dist_glm5.ops import Ops

    from .stage import StageRuntime


def cpu_stage(model, **kw) -> StageRuntime:
    """The reference stage runtime (imported on use: it needs torch, this module does not)."""
    from .stage import CpuStage

    return CpuStage(model, **kw)


@dataclass(frozen=True)
class Backend:
    name: str
    device: str
    dist_backend: str  # torch.distributed backend for tensors between ranks/stages
    ops: "Callable[[], Ops]"  # the hot ops, built on first call (the CPU kernel compiles then)
    # (stage, rank, stages, ranks, init_method) -> a backends.comm.Comm; None: gloo's Comm
    comm: "Callable[..., Any] | None" = None
    # (model, blocks=, block_size=, ...) -> the StageRuntime a worker runs its steps through
    # (backends/stage.py); the CPU's by default: the model as loaded, on the host
    stage: "Callable[..., StageRuntime]" = cpu_stage


_REGISTRY = {"cpu": "dist_glm5.backends.cpu", "hpu": "dist_glm5.backends.hpu"}


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}: choose one of {sorted(_REGISTRY)}")
    return importlib.import_module(_REGISTRY[name]).load()
