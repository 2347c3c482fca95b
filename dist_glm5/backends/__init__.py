"""The one backend boundary. `get_backend("cpu")` is the complete reference; `get_backend("hpu")`
imports the Gaudi stack (habana_frameworks) only when chosen, so nothing else ever imports it.

A backend names its device and collective backend and makes the hot ops (`dist_glm5.ops.Ops`)
the model is built with. A backend other than the CPU reference may also bring its own
communicator (`comm`) and a per-stage runtime (`stage`: device placement, step padding, warm-up);
a stage worker asks for them, so the CPU path runs exactly as it did without them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from dist_glm5.ops import Ops


@dataclass(frozen=True)
class Backend:
    name: str
    device: str
    dist_backend: str  # torch.distributed backend for tensors between ranks/stages
    ops: "Callable[[], Ops]"  # the hot ops, built on first call (the CPU kernel compiles then)
    # (stage, rank, stages, ranks, init_method) -> a backends.comm.Comm; None: gloo's Comm
    comm: "Callable[..., Any] | None" = None
    # (model, spec) -> the stage runtime a worker runs its steps through (backends/hpu/stage.py);
    # None: the model runs as loaded, on the CPU
    stage: "Callable[..., Any] | None" = None


_REGISTRY = {"cpu": "dist_glm5.backends.cpu", "hpu": "dist_glm5.backends.hpu"}


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}: choose one of {sorted(_REGISTRY)}")
    return importlib.import_module(_REGISTRY[name]).load()
