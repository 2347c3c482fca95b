"""RMSNorm and rotary embedding of a decode step's few rows in one C call each
(kernels/norm_rope.c): `rms_norm(x, weight, eps)` and `apply_rope(x, cos, sin, interleave)`,
the signatures of ops/norm.rms_norm and ops/rope.apply_rope, which stay the references beside
them and take whatever these do not (other dtypes, layouts whose last dim is not contiguous, and
for RoPE more than ROWS rows, where torch's vectorised and threaded ops pay). `available()` is
False when the kernel cannot build or DIST_GLM5_KERNELS=0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import Lazy

SOURCE = Path(__file__).with_name("norm_rope.c")
# RoPE: at most this many rows (tokens) per call, more go to torch (bit for bit the same). RMSNorm
# takes every row count: its sum of squares is ours, so a row must not switch paths with the batch.
ROWS = 64
DTYPES = (torch.bfloat16, torch.float32)


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.rms_norm_rows.argtypes = [p, i64, i, i, i, p, f, p, i]
    lib.rms_norm_rows.restype = None
    lib.rope_rows.argtypes = [p, i64, i64, i, i, i, i, p, p, i, p]
    lib.rope_rows.restype = None


_kernel = Lazy(SOURCE, _signatures)

available = _kernel.available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fallback=None) -> torch.Tensor:
    """x [..., D], weight [D] of x's dtype -> [..., D]; `fallback` (ops/norm.rms_norm) takes
    what the kernel does not."""
    lib = _kernel.get()
    D = x.shape[-1]
    rows = x.numel() // max(1, D)
    ok = (
        lib is not None
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and rows > 0
        and x.stride(-1) == 1
        and (x.dim() == 2 or (x.dim() == 1) or x.is_contiguous())
    )
    if not ok:
        if fallback is None:
            raise RuntimeError("norm_rope.rms_norm: not a few-row bf16/fp32 norm; no fallback")
        return fallback(x, weight, eps)
    ld = x.stride(0) if x.dim() == 2 else D
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm_rows(
        x.data_ptr(), ld, rows, D, int(x.dtype == torch.bfloat16), weight.data_ptr(), eps,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def apply_rope(x, cos, sin, interleave: bool, fallback=None) -> torch.Tensor:
    """x [T, dim] or [T, M, dim] (last dim contiguous), cos/sin [T, dim/2] fp32 -> x's shape,
    contiguous; `fallback` (ops/rope.apply_rope) takes what the kernel does not."""
    lib = _kernel.get()
    T = x.shape[0]
    ok = (
        lib is not None
        and x.dtype in DTYPES
        and x.dim() in (2, 3)
        and 0 < T <= ROWS
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == (T, x.shape[-1] // 2)
    )
    if not ok:
        if fallback is None:
            raise RuntimeError("norm_rope.apply_rope: not a few-row rope; no fallback")
        return fallback(x, cos, sin, interleave)
    M = x.shape[1] if x.dim() == 3 else 1
    sm = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rope_rows(
        x.data_ptr(), x.stride(0), sm, T, M, x.shape[-1], int(x.dtype == torch.bfloat16),
        cos.data_ptr(), sin.data_ptr(), int(interleave), out.data_ptr(),
    )  # fmt: skip
    return out
