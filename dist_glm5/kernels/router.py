"""The MoE router of a decode step's few tokens in one C call (kernels/router.c): `route`, the
signature of model/router.route, which stays the reference beside it and takes what this does
not (more than ROWS tokens, where torch's GEMM pays; other dtypes or layouts). `available()` is
False when the kernel cannot build or DIST_GLM5_KERNELS=0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import Lazy

SOURCE = Path(__file__).with_name("router.c")
ROWS = 16  # tokens per call at most; more go to the reference (torch's GEMM is as fast at 32)


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.router.argtypes = [p, i, i, i, p, p, i, i, i, i, i, f, p, p]
    lib.router.restype = i


_kernel = Lazy(SOURCE, _signatures)

available = _kernel.available


def route(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, fallback=None):
    """x [T, H] (bf16 or fp32), weight [E, H] fp32, bias [E] fp32 -> (weights [T, k] fp32,
    ids [T, k] int32), ids highest choice first; `fallback` (model/router.route) takes what the
    kernel does not."""
    lib = _kernel.get()
    ok = (
        lib is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= ROWS
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.is_contiguous()
        and weight.dtype == bias.dtype == torch.float32
        and weight.is_contiguous()
        and bias.is_contiguous()
        and weight.shape[1] == x.shape[1]
    )
    if ok:
        T, E = x.shape[0], weight.shape[0]
        w = torch.empty(T, top_k, dtype=torch.float32)
        ids = torch.empty(T, top_k, dtype=torch.int32)
        rc = lib.router(
            x.data_ptr(), int(x.dtype == torch.bfloat16), T, x.shape[1], weight.data_ptr(),
            bias.data_ptr(), E, top_k, n_group, topk_group, int(norm_topk_prob), scaling,
            w.data_ptr(), ids.data_ptr(),
        )  # fmt: skip
        if rc == -2:
            raise MemoryError("router: no memory for its scores")
        if rc == 0:
            return w, ids
    if fallback is None:
        raise RuntimeError("router: not a few-token fp32 router the kernel takes; no fallback")
    return fallback(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
