"""The project's own TPC op (kernels/tpc/), loaded when built; the native op path otherwise.

`load()` finds the torch-op library (DIST_GLM5_HPU_CUSTOM_OPS, default
kernels/tpc/torch_op/glm5_ops*.so), checks that GC_KERNEL_PATH lists our TPC kernel library
and Habana's own (the graph compiler looks kernels up there), and loads it with
torch.ops.load_library. Absent: None, logged once, and the experts run the native op.

`input_permutation(K)`: the kernel writes each 512-element block's columns in lane order (no
cross-lane moves); x[:, perm] @ W_perm.T == x @ W.T.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

log = logging.getLogger(__name__)
LIB_ENV = "DIST_GLM5_HPU_CUSTOM_OPS"
TPC_DIR = Path(__file__).resolve().parents[2] / "kernels" / "tpc"
HABANA_TPC = "/usr/lib/habanalabs/libtpc_kernels.so"
PERM_BLOCK = 512


@dataclass(frozen=True)
class CustomOps:
    library: str
    dequant_perm: object  # torch.ops.glm5.mxfp4_dequant_perm


def find_library(environ: Mapping[str, str]) -> str | None:
    if environ.get(LIB_ENV):
        return environ[LIB_ENV]
    hits = sorted(glob.glob(str(TPC_DIR / "torch_op" / "glm5_ops*.so")))
    return hits[0] if hits else None


def load(environ: Mapping[str, str] | None = None) -> CustomOps | None:
    environ = os.environ if environ is None else environ
    lib = find_library(environ)
    if lib is None or not Path(lib).exists():
        log.info("custom TPC ops not built (kernels/tpc/README.md): the native MoE op runs")
        return None
    paths = [p for p in environ.get("GC_KERNEL_PATH", "").split(":") if p]
    if HABANA_TPC not in paths or not any(Path(p).name == "libglm5_tpc.so" for p in paths):
        raise RuntimeError(
            f"{lib} is built but GC_KERNEL_PATH={environ.get('GC_KERNEL_PATH', '')!r} does not "
            "list both TPC libraries: export GC_KERNEL_PATH=<repo>/kernels/tpc/build/"
            f"libglm5_tpc.so:{HABANA_TPC}"
        )
    torch.ops.load_library(lib)
    return CustomOps(lib, torch.ops.glm5.mxfp4_dequant_perm)


def input_permutation(K: int) -> torch.Tensor:
    """perm [K] int64: kernel output column p holds input element perm[p]."""
    if K % PERM_BLOCK:
        raise ValueError(f"the TPC dequant kernel needs K a multiple of {PERM_BLOCK}, got {K}")
    p = torch.arange(PERM_BLOCK)
    q, h = p // 2, p % 2
    e = 8 * (q % 64) + 2 * (q // 64) + h
    return (torch.arange(0, K, PERM_BLOCK)[:, None] + e[None]).reshape(-1)
