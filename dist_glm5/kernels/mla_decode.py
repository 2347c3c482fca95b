"""Sparse MLA decode in one C call per layer (kernels/mla_decode.c): `absorbed_gathered`, the
signature of ops/attention.absorbed_gathered (W_uk, attend_gathered, W_uv), which stays the
reference beside it and takes what this does not (mixed dtypes, other layouts).
`available()` is False when the kernel cannot build or DIST_GLM5_KERNELS=0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import Lazy

SOURCE = Path(__file__).with_name("mla_decode.c")
DTYPES = (torch.bfloat16, torch.float32)


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.mla_decode.argtypes = [p, i64, i64, p, p, p, p, p, i, i, i, i, i, i, i, f, i, p, i]
    lib.mla_decode.restype = ctypes.c_int
    lib.mla_decode_row_bytes.argtypes = [i, i, i, i, i]
    lib.mla_decode_row_bytes.restype = i64


_kernel = Lazy(SOURCE, _signatures)

available = _kernel.available


def absorbed_gathered(
    q_nope, q_rot, w_kv_b, kv_store, sel_slots, sel_valid, nope, scale, cap, fallback=None
):
    """q_nope [n, h, nope], q_rot [n, h, r], w_kv_b [h * (nope + v), c], kv_store [S, c + r],
    sel_slots/sel_valid [n, k] -> [n, h, v] in q_nope's dtype. cap: the bytes of scratch a call
    may take (nothing is gathered; rows go in calls under it); `fallback` takes what the kernel
    does not."""
    lib = _kernel.get()
    dt = q_nope.dtype
    n, h = q_nope.shape[0], q_nope.shape[1]
    r = q_rot.shape[-1]
    c = kv_store.shape[1] - r
    ok = (
        lib is not None
        and dt in DTYPES
        and q_rot.dtype == w_kv_b.dtype == kv_store.dtype == dt
        and q_nope.dim() == 3
        and q_nope.stride(-1) == 1
        and q_rot.is_contiguous()
        and w_kv_b.is_contiguous()
        and kv_store.is_contiguous()
        and w_kv_b.shape[1] == c
    )
    if not ok:
        if fallback is None:
            raise RuntimeError("mla_decode: unsupported dtypes or layout, and no fallback")
        return fallback(q_nope, q_rot, w_kv_b, kv_store, sel_slots, sel_valid, nope, scale, cap)
    v = w_kv_b.shape[0] // h - nope
    slots = sel_slots.to(torch.int64).contiguous()
    valid = sel_valid.to(torch.bool).contiguous()
    out = torch.empty(n, h, v, dtype=dt)
    k, bf16 = slots.shape[1], int(dt == torch.bfloat16)
    # the kernel's scratch grows with the rows of a call (GLM-5: about 4.6 MB a row at top-2048),
    # so a prefill chunk's rows go in calls under the cap, as the torch form's gathers do
    row_bytes = lib.mla_decode_row_bytes(h, c, r, k, bf16)
    per = cap // row_bytes
    if per < 1:
        raise ValueError(
            f"mla_decode: one row's scratch ({row_bytes} bytes) exceeds the cap of {cap} bytes: "
            "raise gather_cap_bytes"
        )
    for a in range(0, n, per):
        b = min(n, a + per)
        rc = lib.mla_decode(
            q_nope[a:].data_ptr(), q_nope.stride(0), q_nope.stride(1), q_rot[a:].data_ptr(),
            w_kv_b.data_ptr(), kv_store.data_ptr(), slots[a:].data_ptr(), valid[a:].data_ptr(),
            b - a, h, nope, v, c, r, k, scale, bf16, out[a:].data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("mla_decode: no memory for its scratch")
    return out
