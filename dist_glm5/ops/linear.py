"""Dense projections and the MLA head products, in the activation dtype: the references (torch's
own bf16 GEMM) and the CPU backend's form for CPUs without bf16 GEMM instructions.

On such a CPU (AVX2, no AVX512-BF16 or AMX) torch runs a bf16 GEMM on a slow generic path: one
thread, [256, 128] x [128, 256] took 13 ms in bf16 and 0.22 ms in fp32 here, 60x. The fp32 form
widens both operands (bf16 products are exact in fp32, and torch's bf16 GEMM accumulates in fp32
too), multiplies in fp32 and rounds the result back to the activation dtype: the same values up
to the order of the fp32 additions, no fp32 copy of a weight kept. A single row (a decode GEMV)
stays in bf16 (torch's bf16 GEMV reads half fp32's bytes, though at about 8 GB/s per core here).

A decode step's few rows go to a C kernel when the backend has one (kernels/bf16_gemv.c, these
forms its fallback): it reads the bf16 weight once at memory speed, where widening a whole weight
to fp32 for a few rows, or torch's bf16 GEMV, cost 2-4x more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOW = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    # x [..., K], w [N, K], b [N] -> [..., N] (the reference: torch's, in x's dtype)
    return F.linear(x, w, b)


def einsum(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # two operands of one dtype -> that dtype (the reference: torch's)
    return torch.einsum(eq, a, b)


def _wide(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fp32 form pays: a low-precision product with more than one row."""
    return x.dtype in LOW and w.dtype in LOW and x.numel() > x.shape[-1]


def linear_fp32_gemm(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear` for CPUs without bf16 GEMM: fp32 products, the result in x's dtype."""
    if not _wide(x, w):
        return F.linear(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def einsum_fp32_gemm(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`einsum` for CPUs without bf16 GEMM: fp32 products, the result in a's dtype."""
    if not _wide(a, b):
        return torch.einsum(eq, a, b)
    return torch.einsum(eq, a.float(), b.float()).to(a.dtype)


def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where torch's bf16
    GEMM is fast."""
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
