"""Routed MoE experts on CPU with MXFP4 weights and int8 activations ("w4a8"): opt-in speed at a
documented accuracy cost. The exact kernel (mxfp4_moe.moe_mxfp4) stays the default.

`moe_mxfp4_w4a8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min,
experts_max, fallback=None)` has mxfp4_moe.moe_mxfp4's contract (same layout, same argument
checks, same errors):
  x             [T, H] float32 or bfloat16
  topk_ids      [T, k] int32 (int64 accepted), GLOBAL expert ids
  topk_weights  [T, k] any float dtype
  w13 [E, 2I, H/2] uint8, w13_scale [E, 2I, H/32] uint8: rows [gate; up] per expert
  w2  [E, H, I/2] uint8,  w2_scale  [E, H, I/32] uint8
  experts_min .. experts_max: INCLUSIVE global id range of this rank's E experts
returns [T, H] in x.dtype: sum over routes to THIS rank's experts of
  weight * down(silu(gate(x)) * up(x)), where every product reads its input quantised to int8.

The arithmetic, exactly (tests/test_mxfp4_w4a8.py's float64 oracle implements it on its own):
- Activation quantisation, per row and per block of 32 consecutive inputs x_0..x_31 (fp32; a
  bf16 x is widened exactly first):
      d   = max_i |x_i| / 127                    (fp32 division)
      q_i = round_half_to_even(x_i / d)          (fp32 division, then to int8; |q_i| <= 127)
  all q_i = 0 when d == 0; a block holding inf or NaN gets d = NaN (its rows' results are NaN).
- Weights: code c (4 bits; bit 3 the sign) is the exact integer v = 2 * E2M1[c] in
  {0, 1, 2, 3, 4, 6, 8, 12} with its sign; the block scale of a weight row is
  ws = 2^(byte - 127) / 2 = 2^(byte - 128) (byte 255 = NaN: its rows' results are NaN).
- Block dot: S = sum_i q_i * v_i, exact in int32. Row result
      y = sum over blocks b of  float(S_b) * fp32(d_b * ws_b),
  each term rounded once (an FMA) into fp32 accumulators: the AVX2 path keeps 8 lane partial sums
  (each lane's 4 products of a block, summed over blocks in order) and adds them at the end; the
  scalar path adds S_b * (d_b * ws_b) block after block. The order of those fp32 additions is the
  only difference between the paths and from a float64 evaluation.
- gate, up = the w13 rows . Q(x); act = silu(gate) * up in fp32 (gate / (1 + expf(-gate)) * up);
  act is quantised per block of 32 the same way; out[t] += weight * (the w2 rows . Q(act)),
  summed in fp32 over the token's local routes, and cast to x.dtype at the end.

Accuracy: on random experts shaped like the small model (H=1024, I=512, k=8, scale bytes
118..127, x ~ N(0, 1)) the output differs from the exact kernel's by 1.0e-2 relative RMS
(tests/test_mxfp4_w4a8.py measures it and asserts < 3e-2): int8 keeps ~7 bits of each activation
against its block's maximum, at both the gate/up and the down products.

Speed (AVX2): the exact kernel decodes each weight to fp32 and spends one FMA lane per MAC; here a
block of 32 codes is one vpshufb on a 16-entry int8 table and 32 MACs are vpsignb + vpmaddubsw +
vpmaddwd, then one convert + FMA per block (llama.cpp's MXFP4 x Q8_0 product). Grouping by
expert, threading and prefetch are the exact kernel's. Measured by bench/w4a8.py (small model,
one thread, AMD EPYC Zen 3 shared with a training run): 1.25-1.3x the exact kernel at 1, 8 and 32
tokens. The per-block fp32 scaling (vpmaddwd, convert, FMA for every 32 MACs of every row x
token) keeps it compute bound; AVX512-VNNI / AVX-VNNI (vpdpbusd) would fold two of those steps.

`linear_w4a8(x, packed, scales)` is one such product ([T, K] x [R, K] packed -> [T, R] fp32),
used by the tests to check a single projection exactly. `set_isa("scalar" | "avx2" | None)`
forces the code path (tests, benchmarks). `available()` is False when the kernel cannot build
or DIST_GLM5_KERNELS=0; then `moe_mxfp4_w4a8` runs `fallback` (e.g. the exact reference) after
the same checks, or raises if none was passed.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .build import Lazy
from .mxfp4_moe import _as, _check

SOURCE = Path(__file__).with_name("mxfp4_w4a8.c")
ISA_NAMES = ("scalar", "avx2")


def _signatures(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.w4_set_isa.argtypes, lib.w4_set_isa.restype = [i], i
    lib.w4_linear.argtypes, lib.w4_linear.restype = [p, i, i, i, p, p, i, p, i], i
    lib.w4_moe_forward.argtypes = [p, i, i, i, i, i, p, p, i, i, p, p, p, p, p, i]
    lib.w4_moe_forward.restype = i
    lib.w4_set_isa(-1)


_kernel = Lazy(SOURCE, _signatures)
available = _kernel.available


def _lib() -> ctypes.CDLL:
    lib = _kernel.get()
    if lib is None:
        raise RuntimeError("the MXFP4 w4a8 kernel is unavailable (see the build warning)")
    return lib


def set_isa(isa: str | None = None) -> str:
    """Force the code path ("scalar", "avx2"; None = the best this CPU has). Returns the path in
    use (a request above what the CPU supports is lowered). For tests and benchmarks; not
    thread safe."""
    return ISA_NAMES[_lib().w4_set_isa(-1 if isa is None else ISA_NAMES.index(isa))]


def linear_w4a8(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    """x [T, K] float32/bfloat16, packed [R, K/2], scales [R, K/32] uint8 -> [T, R] fp32:
    row r of the result is the packed rows . Q(x[t]) (the arithmetic in the module docstring)."""
    R, K = packed.shape[0], x.shape[-1]
    ok = (
        x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and packed.dtype == scales.dtype == torch.uint8
        and K % 32 == 0
        and tuple(packed.shape) == (R, K // 2)
        and tuple(scales.shape) == (R, K // 32)
        and all(t.is_cpu for t in (x, packed, scales))
    )
    if not ok:
        raise ValueError(
            f"linear_w4a8 takes CPU x [T, K] float32/bfloat16, packed [R, K/2] and scales "
            f"[R, K/32] uint8, K a multiple of 32; got {tuple(x.shape)} {x.dtype}, "
            f"{tuple(packed.shape)} {packed.dtype}, {tuple(scales.shape)} {scales.dtype}"
        )
    lib = _lib()
    xc, packed, scales = _as(x, x.dtype), _as(packed, torch.uint8), _as(scales, torch.uint8)
    out = torch.empty(x.shape[0], R, dtype=torch.float32)
    rc = lib.w4_linear(
        xc.data_ptr(),
        int(x.dtype == torch.bfloat16),
        x.shape[0],
        K,
        packed.data_ptr(),
        scales.data_ptr(),
        R,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("w4_linear could not allocate its scratch buffers")
    return out


def moe_mxfp4_w4a8(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    experts_min: int,
    experts_max: int,
    fallback: Callable[..., Tensor] | None = None,
) -> Tensor:
    """The routed experts of this rank with int8 activations (contract and arithmetic in the
    module docstring). fallback: what runs, after the same checks, when the kernel is
    unavailable (same arguments; e.g. ops/experts.experts_mxfp4_reference, the exact path).
    None: that is an error."""
    E, H, I = _check(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max
    )
    lib = _kernel.get()
    if lib is None:
        if fallback is None:
            raise RuntimeError(
                "the MXFP4 w4a8 kernel is unavailable (see the build warning) and "
                "no fallback was passed"
            )
        return fallback(
            x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max
        )
    T, k = topk_ids.shape
    xc, ids, tw = _as(x, x.dtype), _as(topk_ids, torch.int32), _as(topk_weights, torch.float32)
    w13, w13_scale, w2, w2_scale = (_as(t, torch.uint8) for t in (w13, w13_scale, w2, w2_scale))
    out = torch.empty(T, H, dtype=torch.float32)
    rc = lib.w4_moe_forward(
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
    )
    if rc != 0:
        raise MemoryError("w4_moe_forward could not allocate its scratch buffers")
    return out if x.dtype == torch.float32 else out.to(x.dtype)
