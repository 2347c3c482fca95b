"""The one backend boundary. `get_backend("cpu")` is the complete reference; `get_backend("hpu")`
imports the Gaudi stack (habana_frameworks) only when chosen, so nothing else ever imports it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str
    device: str
    dist_backend: str  # torch.distributed backend for tensors between ranks/stages


_REGISTRY = {"cpu": "dist_glm5.backends.cpu", "hpu": "dist_glm5.backends.hpu"}


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}: choose one of {sorted(_REGISTRY)}")
    return importlib.import_module(_REGISTRY[name]).load()
