"""The one backend boundary. `get_backend("cpu")` is the complete reference; `get_backend("hpu")`
imports the Gaudi stack (habana_frameworks) only when chosen, so nothing else ever imports it.

A backend names its device and collective backend and makes the hot ops (`dist_glm5.ops.Ops`)
the model is built with.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from dist_glm5.ops import Ops


@dataclass(frozen=True)
class Backend:
    name: str
    device: str
    dist_backend: str  # torch.distributed backend for tensors between ranks/stages
    ops: "Callable[[], Ops]"  # the hot ops, built on first call (the CPU kernel compiles then)


_REGISTRY = {"cpu": "dist_glm5.backends.cpu", "hpu": "dist_glm5.backends.hpu"}


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}: choose one of {sorted(_REGISTRY)}")
    return importlib.import_module(_REGISTRY[name]).load()


def default_ops() -> "Ops":
    """What a model built without explicit ops runs: the CPU backend's choice."""
    return get_backend("cpu").ops()
