"""The only importer of habana_frameworks: one accessor per entry point, each importing lazily.

Every accessor raises the backend's one clear error when the Gaudi stack is missing, so a caller
never sees a bare ImportError. Nothing here runs at import time (tests/test_imports.py imports
every module with habana_frameworks blocked).
"""

from __future__ import annotations

import importlib
from types import ModuleType

MISSING = (
    "backend 'hpu' needs the Gaudi software stack (habana_frameworks), which is not installed "
    "here: run on a Gaudi image whose torch build ships it, or choose --backend cpu"
)


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(f"{MISSING} (importing {name}: {e})") from e


def core() -> ModuleType:
    """habana_frameworks.torch.core: registers the 'hpu' device and the native ops; mark_step."""
    return _import("habana_frameworks.torch.core")


def hpu() -> ModuleType:
    """habana_frameworks.torch.hpu: synchronize."""
    return _import("habana_frameworks.torch.hpu")


def fused_sdpa():
    return _import("habana_frameworks.torch.hpex.kernels").FusedSDPA


def fused_rms_norm():
    return _import("habana_frameworks.torch.hpex.normalization").FusedRMSNorm


def is_lazy() -> bool:
    """Lazy mode (PT_HPU_LAZY_MODE=1) as the bridge sees it."""
    return bool(_import("habana_frameworks.torch.utils.internal").is_lazy())


def bridge_config() -> ModuleType | None:
    """habana_frameworks.torch.internal.bridge_config (env_setting), or None where absent."""
    try:
        return importlib.import_module("habana_frameworks.torch.internal.bridge_config")
    except ImportError:
        return None


def import_hccl() -> None:
    """Registers the 'hccl' torch.distributed backend."""
    _import("habana_frameworks.torch.distributed.hccl")


def plugin_dirs() -> tuple[str, str]:
    """(include dir, lib dir) of the installed habana_pytorch plugin: for building the TPC torch
    op (kernels/tpc/torch_op/setup.py)."""
    lib_utils = _import("habana_frameworks.torch.utils.lib_utils")
    return lib_utils.get_include_dir(), lib_utils.get_lib_dir()
