"""Routed MoE experts on CPU, reading the packed MXFP4 serving layout directly.

`moe_mxfp4(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max)`
mirrors the Gaudi op `torch.ops.hpu.mixture_of_experts.mxfp4_fused_weights` (shared/gaudi.md §1):
  x             [T, H] float32 or bfloat16
  topk_ids      [T, k] int32 (int64 accepted), GLOBAL expert ids
  topk_weights  [T, k] any float dtype
  w13 [E, 2I, H/2] uint8, w13_scale [E, 2I, H/32] uint8: rows [gate; up] per expert
  w2  [E, H, I/2] uint8,  w2_scale  [E, H, I/32] uint8
  experts_min .. experts_max: INCLUSIVE global id range of this rank's E experts
returns [T, H] in x.dtype: sum over routes to THIS rank's experts of
  weight * down(silu(gate(x)) * up(x)), computed in fp32 (routes elsewhere contribute 0).

Two paths, chosen per expert by how many routes it has in the call:
- fewer than `GEMM_MIN_ROUTES` (every expert in decode): the C kernel (mxfp4_moe.c) streams the
  expert's packed rows once for all its tokens and unpacks them in registers. Memory bound at
  a few tokens per expert, then bound by its FMAs (AVX-512 or AVX2, picked at run time; with
  AVX512-BF16 and bf16 x, gate/up take vdpbf16ps where that is exact, see mxfp4_moe.c).
- at least `GEMM_MIN_ROUTES` (prefill): the expert is decoded by the C decoder a 4 MiB fp32
  tile at a time and each tile multiplied with torch (MKL), which has the faster GEMM once
  enough tokens share the decode. Not on the AVX-512 paths of a CPU where MKL runs its AVX2
  code (any but Intel's: `default_gemm_min_routes`).
The plain torch loop both are checked against is ops/experts.py's `experts_mxfp4_reference`;
kernels/ imports nothing of ops/ (the seam picks the kernel, not the other way round), so a caller
that wants a fallback when the kernel is unavailable (no compiler, build failure, or
DIST_GLM5_KERNELS=0) passes it in (`fallback=`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import Lazy

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("mxfp4_moe.c")
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16", "amx")
# Caps the code path when the library loads (one of ISA_NAMES), e.g. to run a benchmark or the
# serving loop on the AVX-512F path of a CPU that has AVX512-BF16; set_isa() overrides it.
ISA_ENV = "DIST_GLM5_MXFP4_ISA"
# Per code path, the routes per expert from which decode-a-tile + torch GEMM beats the fused
# kernel: where the two cross in `bench kernels`' one-expert sweep (2-core AVX-512 Xeon, fused vs
# GEMM ms). AVX-512, 2 threads: GLM-5 28.9 vs 29.5 at 64 routes, 59.9 vs 46.9 at 128; small model
# 1.34 vs 1.57 at 64, 2.64 vs 2.26 at 128 (1 thread: crossing between 48 and 80). AVX2, 2
# threads: GLM-5 19.0 vs 18.2 at 24, 25.2 vs 20.3 at 32; small 0.86 vs 0.86 at 24. The scalar
# path is ~10x slower than AVX2, so there the GEMM wins from a few tokens.
GEMM_MIN_ROUTES = {"scalar": 4, "avx2": 24, "avx512": 64, "avx512bf16": 64, "amx": 64}
# torch's fp32 GEMM is MKL's, which runs its AVX-512 code on Intel CPUs only: on an AMD Zen 5 it
# ran at AVX2 speed (215 GFLOP/s on 2 threads, oneDNN's AVX-512 GEMM 470), and the fused kernel's
# AVX-512 paths beat decode + GEMM at every size measured (small model, 16-2048 routes to one
# expert, fp32 and bf16 x, 1 and 2 threads: 1.5-2.3x). There the AVX-512 paths never take it.
MKL_AVX512_VENDORS = ("GenuineIntel",)

_isa = "scalar"  # the kernel's code path in use


def _signatures(lib: ctypes.CDLL) -> None:
    global _isa
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.mx_set_isa.argtypes, lib.mx_set_isa.restype = [i], i
    lib.mx_decode.argtypes, lib.mx_decode.restype = [p, p, i64, i, p, i], None
    lib.mx_moe_forward.argtypes = [p, i, i, i, i, i, p, p, i, i, p, p, p, p, p, i, i, p]
    lib.mx_moe_forward.restype = i
    lib.mx_w13_rows.argtypes, lib.mx_w13_rows.restype = [p], None
    lib.mx_silu_mul.argtypes, lib.mx_silu_mul.restype = [p, p, i, p], i
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if cap and cap not in ISA_NAMES:
        log.warning("%s=%r is none of %s: ignored", ISA_ENV, cap, ISA_NAMES)
        cap = ""
    _isa = ISA_NAMES[lib.mx_set_isa(ISA_NAMES.index(cap) if cap else -1)]


_kernel = Lazy(SOURCE, _signatures)
available = _kernel.available


def set_isa(isa: str | None = None) -> str:
    """Force the kernel's code path (one of ISA_NAMES; None = the best this CPU has).
    Returns the path in use (a request above what the CPU supports is lowered). For tests and
    benchmarks; not thread safe."""
    global _isa
    lib = _kernel.get()
    if lib is None:
        raise RuntimeError("the MXFP4 MoE kernel is not available")
    _isa = ISA_NAMES[lib.mx_set_isa(-1 if isa is None else ISA_NAMES.index(isa))]
    return _isa


def w13_rows() -> tuple[int, int]:
    """(bf16, fp32): the gate/up rows computed by the AVX512-BF16 kernels (or AMX tiles) and by
    the fp32 ones since the last call (w13_counts' first two). For tests: which path ran."""
    return w13_counts()[:2]


def w13_counts() -> tuple[int, int, int]:
    """(bf16, fp32, amx): w13_rows' counts and, of the bf16 rows, those on the AMX tiles, since
    the last call (process-wide counts, then reset). For tests."""
    lib = _kernel.get()
    if lib is None:
        raise RuntimeError("the MXFP4 MoE kernel is not available")
    out = (ctypes.c_int64 * 3)()
    lib.mx_w13_rows(out)
    return out[0], out[1], out[2]


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) * u [cols] fp32 (cols a multiple of 32) by the code path the forward computes its
    activations with (AVX-512: a vector exp, not libm's expf). For tests."""
    lib = _kernel.get()
    if lib is None:
        raise RuntimeError("the MXFP4 MoE kernel is not available")
    g, u = g.float().contiguous(), u.float().contiguous()
    if g.dim() != 1 or g.shape != u.shape or len(g) % 32:
        raise ValueError(
            f"g and u must be [cols] with cols a multiple of 32, got {g.shape}, {u.shape}"
        )
    out = torch.empty_like(g)
    if lib.mx_silu_mul(g.data_ptr(), u.data_ptr(), len(g), out.data_ptr()):
        raise MemoryError("mx_silu_mul: no memory for its buffer")
    return out


def _check(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    experts_min: int,
    experts_max: int,
) -> tuple[int, int, int]:
    """Validate shapes and dtypes; returns (E, H, I). Cheap when all is well (it runs on every
    decode step): messages are only built on failure."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be [T, H] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    T = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [T={T}, k]"
        )
    weights = (w13, w13_scale, w2, w2_scale)
    if any(t.dtype != torch.uint8 for t in weights):
        raise ValueError("w13, w13_scale, w2, w2_scale must be uint8 (packed E2M1 / E8M0)")
    if not all(t.is_cpu for t in (x, topk_ids, topk_weights, *weights)):
        raise ValueError("moe_mxfp4 is the CPU kernel: every tensor must be on the CPU")
    E, H, I = w13.shape[0], x.shape[1], w13.shape[1] // 2
    want = ((E, 2 * I, H // 2), (E, 2 * I, H // 32), (E, H, I // 2), (E, H, I // 32))
    if H % 32 or I % 32 or any(t.shape != s for t, s in zip(weights, want)):
        names = ("w13", "w13_scale", "w2", "w2_scale")
        raise ValueError(
            f"MXFP4 expert shapes for H={H}, I={I} (both multiples of 32): want "
            f"{dict(zip(names, want))}, got "
            f"{ {n: tuple(t.shape) for n, t in zip(names, weights)} }"
        )
    if experts_max - experts_min + 1 != E:
        raise ValueError(
            f"experts_min..experts_max = {experts_min}..{experts_max} (inclusive) "
            f"must span the {E} local experts"
        )
    return E, H, I


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in dtype and contiguous, without a copy (or a dispatcher round trip) when it already is."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _decode_reference(packed: Tensor, scales: Tensor) -> Tensor:
    """The project's MXFP4 codec, to fp32."""
    from dist_glm5.quant.mxfp4 import decode

    return decode(packed, scales, torch.float32)


def decode(packed: Tensor, scales: Tensor) -> Tensor:
    """packed [R, K/2], scales [R, K/32] (uint8) -> fp32 [R, K], with the C decoder (the
    reference codec if the kernel is unavailable)."""
    rows, K = packed.shape[0], packed.shape[-1] * 2
    if (
        packed.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or packed.dim() != 2
        or K % 32
        or tuple(scales.shape) != (rows, K // 32)
        or not packed.is_cpu
    ):
        raise ValueError(
            f"decode takes CPU uint8 packed [R, K/2] and scales [R, K/32], K a "
            f"multiple of 32; got {tuple(packed.shape)} {packed.dtype} and "
            f"{tuple(scales.shape)} {scales.dtype}"
        )
    lib = _kernel.get()
    if lib is None:
        return _decode_reference(packed, scales)
    packed, scales = packed.contiguous(), scales.contiguous()
    out = torch.empty(rows, K, dtype=torch.float32)
    lib.mx_decode(
        packed.data_ptr(), scales.data_ptr(), rows, K, out.data_ptr(), torch.get_num_threads()
    )
    return out


# Decoded fp32 tile per GEMM: decoding a whole expert (151 MB in fp32 for GLM-5) would write it to
# DRAM and read it back; 4 MiB stays in cache and is big enough for MKL to run near its speed on
# these skinny products (measured, GLM-5 shapes, 128 tokens: 1 MiB 65, 4 MiB 99, 16 MiB 98 GFLOP/s).
_TILE_BYTES = 4 << 20


def _tiled_linear_t(
    lib: ctypes.CDLL, xt: Tensor, packed: Tensor, scales: Tensor, buf: Tensor
) -> Tensor:
    """decode(packed, scales) @ xt -> [rows, n]: xt is x transposed [K, n]; the weight is
    decoded a tile of rows at a time into `buf` and each tile multiplied while in cache."""
    rows, K = packed.shape[0], packed.shape[1] * 2
    step = max(16, _TILE_BYTES // (4 * K) // 16 * 16)
    out = torch.empty(rows, xt.shape[1], dtype=torch.float32)
    p0, s0, nthreads = packed.data_ptr(), scales.data_ptr(), torch.get_num_threads()
    for r0 in range(0, rows, step):
        r = min(step, rows - r0)
        tile = buf[: r * K].view(r, K)
        lib.mx_decode(p0 + r0 * (K // 2), s0 + r0 * (K // 32), r, K, tile.data_ptr(), nthreads)
        torch.mm(tile, xt, out=out[r0 : r0 + r])
    return out


def _gemm_experts(
    lib: ctypes.CDLL,
    x: Tensor,
    local_ids: Tensor,
    tw: Tensor,
    experts: list[int],
    weights: tuple[Tensor, Tensor, Tensor, Tensor],
    out: Tensor,
) -> None:
    """out[t] += w * down(silu(gate(x_t)) * up(x_t)) for the routes to `experts` (local ids),
    as decode-a-tile + torch GEMM: the prefill path, for experts with many tokens."""
    w13, s13, w2, s2 = weights
    buf = torch.empty(_TILE_BYTES // 4 + max(w13.shape[2], w2.shape[2]) * 32, dtype=torch.float32)
    I = w13.shape[1] // 2
    for e in experts:
        tok, slot = torch.where(local_ids == e)
        h = _tiled_linear_t(lib, x[tok].t(), w13[e], s13[e], buf)  # [2I, n]
        act = F.silu(h[:I]) * h[I:]  # [I, n]
        y = _tiled_linear_t(lib, act, w2[e], s2[e], buf)  # [H, n]
        out.index_add_(0, tok, y.t() * tw[tok, slot, None])


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (cpuid's, as /proc/cpuinfo gives it); "" when unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_gemm_min_routes(isa: str, vendor: str) -> int:
    """GEMM_MIN_ROUTES of a code path, unless torch's GEMM lacks AVX-512 where the path has it
    (an unknown vendor keeps the table's figure)."""
    if isa.startswith(("avx512", "amx")) and vendor and vendor not in MKL_AVX512_VENDORS:
        return NEVER
    return GEMM_MIN_ROUTES[isa]


NEVER = 2**31 - 1  # the kernel's int: no expert takes the GEMM path


def gemm_threshold(gemm_min_routes: int | None = None) -> int:
    """Routes from which an expert takes the decode + GEMM path (moe_mxfp4's gemm_min_routes;
    None: the default of the code path in use on this CPU), as the kernel's int."""
    if gemm_min_routes is None:
        return default_gemm_min_routes(_isa, cpu_vendor())
    return min(max(gemm_min_routes, 1), NEVER)


def moe_mxfp4(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    experts_min: int,
    experts_max: int,
    gemm_min_routes: int | None = None,
    fallback: Callable[..., Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """The routed experts of this rank (contract in the module docstring).

    gemm_min_routes: experts with at least this many routes in the call go through
    decode + torch GEMM (default: default_gemm_min_routes on this CPU; a huge value forces
    the fused kernel, 1 the GEMM path).
    fallback: what runs, after the same checks, when the kernel is unavailable (same arguments,
    without gemm_min_routes; e.g. ops/experts.experts_mxfp4_reference). None: that is an error.
    out_dtype: the result's dtype (default x.dtype); float32 returns the fp32 sums unrounded.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lib = _kernel.get()
    if lib is None:
        if fallback is None:
            raise RuntimeError(
                "the MXFP4 MoE kernel is unavailable (see the build warning) and "
                "no fallback was passed"
            )
        _check(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max)
        return fallback(
            x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max
        ).to(out_dtype)
    E, H, I = _check(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max
    )
    T, k = topk_ids.shape
    thr = gemm_threshold(gemm_min_routes)
    xc, ids, tw = _as(x, x.dtype), _as(topk_ids, torch.int32), _as(topk_weights, torch.float32)
    w13, w13_scale, w2, w2_scale = (_as(t, torch.uint8) for t in (w13, w13_scale, w2, w2_scale))
    out = torch.empty(T, H, dtype=torch.float32)
    # per-expert route counts are only needed when some expert may reach the GEMM threshold
    counts = torch.empty(E, dtype=torch.int32) if T * k >= thr else None
    rc = lib.mx_moe_forward(
        xc.data_ptr(),
        int(x.dtype == torch.bfloat16),
        T,
        H,
        I,
        k,
        ids.data_ptr(),
        tw.data_ptr(),
        experts_min,
        E,
        w13.data_ptr(),
        w13_scale.data_ptr(),
        w2.data_ptr(),
        w2_scale.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
        thr,
        None if counts is None else counts.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("mx_moe_forward could not allocate its scratch buffers")
    if counts is not None:
        heavy = torch.nonzero(counts >= thr).flatten().tolist()
        if heavy:
            _gemm_experts(
                lib,
                xc.float(),
                ids.long() - experts_min,
                tw,
                heavy,
                (w13, w13_scale, w2, w2_scale),
                out,
            )
    return out if out_dtype == torch.float32 else out.to(out_dtype)
