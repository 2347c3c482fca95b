"""bf16 products of a few rows in C (kernels/bf16_gemv.c): `linear(x, w, b)`, torch's F.linear
for bf16 x [..., K] with at most ROWS rows and bf16 w [N, K], bias [N] -> [..., N] bf16; and
`experts(...)`, ops/experts.experts_dense_reference for at most ROWS tokens with bf16 weights
(the reference beside it, which takes every other call).

The reference beside it is F.linear itself (ops/linear.py); the kernel only changes the order of
the fp32 additions. `available()` is False when it cannot build or DIST_GLM5_KERNELS=0; callers
then keep torch's path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import Lazy

SOURCE = Path(__file__).with_name("bf16_gemv.c")
# The rows up to which the kernel beats the fp32 GEMM (which first widens the whole weight) on
# this 2-core AVX2 machine, one thread: 1.1-3.1x at 32 rows, 0.7-1.5x at 64 (bench linear).
ROWS = 32


def _signatures(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.bf16_gemv.argtypes = [p, i, i, p, i, p, p, i]
    lib.bf16_gemv.restype = i
    lib.bf16_experts.argtypes = [p, i, i, i, i, p, p, i, i, p, p, p, i]
    lib.bf16_experts.restype = i
    lib.bf16_gemv_amx.argtypes = [i]
    lib.bf16_gemv_amx.restype = i
    lib.bf16_gemv_zmm.argtypes = []
    lib.bf16_gemv_zmm.restype = i


_kernel = Lazy(SOURCE, _signatures)

available = _kernel.available


def uses_amx(K: int) -> bool:
    """Whether products of K inputs take the AMX-BF16 tiles here (the CPU has them, Linux grants
    them, K % 32 == 0 and DIST_GLM5_GEMV_AMX is not 0)."""
    lib = _kernel.get()
    return lib is not None and bool(lib.bf16_gemv_amx(K))


def uses_zmm() -> bool:
    """Whether the fp32 tiles take 16 lanes here (the CPU has AVX-512 but not AVX512-BF16, or
    DIST_GLM5_GEMV_FP32=1 keeps the fp32 tiles, and DIST_GLM5_GEMV_ZMM is not 0)."""
    lib = _kernel.get()
    return lib is not None and bool(lib.bf16_gemv_zmm())


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` takes this product: bf16 operands, at most ROWS rows, a contiguous
    weight."""
    return (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.numel() <= ROWS * x.shape[-1]
        and w.dim() == 2
        and w.is_contiguous()
    )


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, fallback=None
) -> torch.Tensor:
    """x [..., K] bf16 (at most ROWS rows), w [N, K] bf16 contiguous, b [N] -> [..., N] bf16;
    `fallback(x, w, b)` takes every other product (without one they are an error)."""
    lib = _kernel.get()
    if lib is None or not fits(x, w) or (b is not None and b.dtype != torch.bfloat16):
        if fallback is None:
            raise RuntimeError("bf16_gemv: unavailable, or not a few-row bf16 product")
        return fallback(x, w, b)
    K, N = w.shape[1], w.shape[0]
    if x.shape[-1] != K:
        raise ValueError(f"bf16_gemv: x has {x.shape[-1]} inputs, w takes {K}")
    xc = x.reshape(-1, K).contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16)
    bc = None if b is None else b.contiguous()
    rc = lib.bf16_gemv(
        xc.data_ptr(),
        xc.shape[0],
        K,
        w.data_ptr(),
        N,
        None if bc is None else bc.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("bf16_gemv: no memory for the fp32 copy of x")
    return y


def experts(x, topk_ids, topk_weights, w13, w2, experts_min, experts_max, fallback=None):
    """ops/experts.experts_dense's contract: x [T, H], topk_ids [T, k] global ids, topk_weights
    [T, k], w13 [E, 2I, H], w2 [E, H, I] -> [T, H], this rank's experts only. Takes bf16 x and
    weights (contiguous) of at most ROWS tokens; `fallback` takes the rest."""
    lib = _kernel.get()
    T, H = x.shape
    ok = (
        lib is not None
        and x.dtype == w13.dtype == w2.dtype == torch.bfloat16
        and 0 < T <= ROWS
        and w13.is_contiguous()
        and w2.is_contiguous()
    )
    if not ok:
        if fallback is None:
            raise RuntimeError("bf16_gemv.experts: not a few-token bf16 call, and no fallback")
        return fallback(x, topk_ids, topk_weights, w13, w2, experts_min, experts_max)
    E, I = w13.shape[0], w2.shape[2]
    if experts_max - experts_min + 1 != E or w13.shape[1:] != (2 * I, H) or w2.shape[1] != H:
        raise ValueError(
            f"bf16 experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not make experts "
            f"{experts_min}..{experts_max} of hidden {H}"
        )
    xc = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(T, H, dtype=torch.bfloat16)
    rc = lib.bf16_experts(
        xc.data_ptr(), T, H, I, ids.shape[1], ids.data_ptr(), tw.data_ptr(), experts_min, E,
        w13.data_ptr(), w2.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("bf16_gemv.experts: no memory for its buffers")
    return out
