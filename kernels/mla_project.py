"""A decode step's MLA and DSA-indexer projections in one C call per layer
(kernels/mla_project.c): `project`, the op `Ops.mla_project` (its contract and weights in
dist_glm5/ops/mla_project.py). It declines (returns None) what it does not take: other dtypes
than bf16, more than ROWS rows (bf16_gemv's), layouts that are not contiguous; the model then
composes the ops itself, which is the reference this is tested against. `available()` is False
when the kernel cannot build or DIST_GLM5_KERNELS=0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import Lazy

SOURCE = Path(__file__).with_name("mla_project.c")
# the rows bf16_gemv takes (its tiles here give its bits); more go to the composed ops (torch GEMMs)
ROWS = 32
STORES = (torch.bfloat16, torch.float32)

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Args(ctypes.Structure):
    """struct mla_proj (field for field)."""

    _fields_ = [
        *((n, _i) for n in ("T", "H", "q_lora", "heads", "nope", "rope", "kv_lora", "interleave")),
        *((n, _p) for n in ("x", "w_qa", "b_qa", "n_qa", "w_qb", "w_kva", "b_kva", "n_kva")),
        ("eps_qa", _f),
        ("eps_kva", _f),
        *((n, _p) for n in ("cos", "sin", "slots")),
        ("n_slots", ctypes.c_int64),
        ("kv_store", _p),
        ("kv_bf16", _i),
        *((n, _i) for n in ("i_heads", "i_dim", "i_interleave", "idx_bf16")),
        *((n, _p) for n in ("w_iq", "w_ik", "ln_w", "ln_b", "w_iw")),
        ("eps_ln", _f),
        ("iw_scale", _f),
        *((n, _p) for n in ("idx_store", "q", "q_rot", "iq", "iw")),
    ]


def _signatures(lib: ctypes.CDLL) -> None:
    lib.mla_project.argtypes = [ctypes.POINTER(_Args), _i]
    lib.mla_project.restype = _i


_kernel = Lazy(SOURCE, _signatures)

available = _kernel.available


def _bf16(*ts) -> bool:
    return all(t is None or (t.dtype == torch.bfloat16 and t.is_contiguous()) for t in ts)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def project(x, w, cos, sin, slots, kv_store, idx_store):
    """ops/mla_project.py's contract (w: its ProjectWeights, read by field); None when not
    taken."""
    lib = _kernel.get()
    T = x.shape[0]
    ix = w.indexer
    ok = (
        lib is not None
        and x.dim() == 2
        and 0 < T <= ROWS
        and _bf16(x, w.q_a, w.q_a_bias, w.q_a_norm, w.q_b, w.kv_a, w.kv_a_bias, w.kv_a_norm)
        and w.rope <= 512
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == (T, w.rope // 2)
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and kv_store.dtype in STORES
        and kv_store.is_contiguous()
        and slots.shape == (T,)
        and (
            ix is None
            or (
                _bf16(ix.wq_b, ix.wk, ix.k_norm_weight, ix.k_norm_bias, ix.weights_proj)
                and idx_store is not None
                and idx_store.dtype in STORES
                and idx_store.is_contiguous()
                and idx_store.shape[0] == kv_store.shape[0]
            )
        )
    )
    if not ok:
        return None
    h, hd = w.heads, w.nope + w.rope
    q = torch.empty(T, h, hd, dtype=torch.bfloat16)
    q_rot = torch.empty(T, h, w.rope, dtype=torch.bfloat16)
    a = _Args(
        T, x.shape[1], w.q_a.shape[0], h, w.nope, w.rope, w.kv_lora, int(w.interleave),
        x.data_ptr(), w.q_a.data_ptr(), _ptr(w.q_a_bias), w.q_a_norm.data_ptr(),
        w.q_b.data_ptr(), w.kv_a.data_ptr(), _ptr(w.kv_a_bias), w.kv_a_norm.data_ptr(),
        w.q_a_eps, w.kv_a_eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
        kv_store.shape[0], kv_store.data_ptr(), int(kv_store.dtype == torch.bfloat16),
    )  # fmt: skip
    a.q, a.q_rot = q.data_ptr(), q_rot.data_ptr()
    iq = iw = None
    if ix is not None:
        iq = torch.empty(T, ix.heads, ix.head_dim, dtype=torch.bfloat16)
        iw = torch.empty(T, ix.heads, dtype=torch.float32)
        a.i_heads, a.i_dim, a.i_interleave = ix.heads, ix.head_dim, int(ix.interleave)
        a.idx_bf16 = int(idx_store.dtype == torch.bfloat16)
        a.w_iq, a.w_ik, a.w_iw = ix.wq_b.data_ptr(), ix.wk.data_ptr(), ix.weights_proj.data_ptr()
        a.ln_w, a.ln_b = ix.k_norm_weight.data_ptr(), ix.k_norm_bias.data_ptr()
        a.eps_ln, a.iw_scale = ix.k_norm_eps, ix.heads**-0.5
        a.idx_store, a.iq, a.iw = idx_store.data_ptr(), iq.data_ptr(), iw.data_ptr()
    rc = lib.mla_project(ctypes.byref(a), torch.get_num_threads())
    if rc == -3:
        raise IndexError(f"mla_project: a slot of {slots.tolist()} is outside the cache's rows")
    if rc != 0:
        raise MemoryError("mla_project: no memory for its scratch")
    return q, q_rot, iq, iw
