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

from dist_glm5.quant import index_q8

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
        *((n, _i) for n in ("i_heads", "i_dim", "i_interleave", "idx_kind")),
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


def weights_ok(w) -> bool:
    """Whether the kernel takes these weights (ProjectWeights): bf16 and contiguous."""
    ix = w.indexer
    return (
        _bf16(w.q_a, w.q_a_bias, w.q_a_norm, w.q_b, w.kv_a, w.kv_a_bias, w.kv_a_norm)
        and w.rope <= 512
        and (ix is None or _bf16(ix.wq_b, ix.wk, ix.k_norm_weight, ix.k_norm_bias, ix.weights_proj))
    )


def step_ok(x, w, cos, sin, slots, kv_store, idx_store) -> bool:
    """Whether the kernel takes this step's inputs (the weights checked by weights_ok)."""
    T = x.shape[0]
    return (
        x.dim() == 2
        and 0 < T <= ROWS
        and x.dtype == torch.bfloat16
        and x.is_contiguous()
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == (T, w.rope // 2)
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.shape == (T,)
        and kv_store.dtype in STORES
        and kv_store.is_contiguous()
        and (
            w.indexer is None
            or (
                idx_store is not None
                and idx_store.dtype in index_q8.KERNEL_KINDS
                and idx_store.is_contiguous()
                and idx_store.shape[0] == kv_store.shape[0]
            )
        )
    )


def prepare(w) -> _Args:
    """The call's arguments that depend on the weights alone (w: ProjectWeights that weights_ok
    takes), filled once; `run` fills a step's."""
    a = _Args()
    a.H, a.q_lora, a.heads = w.q_a.shape[1], w.q_a.shape[0], w.heads
    a.nope, a.rope, a.kv_lora, a.interleave = w.nope, w.rope, w.kv_lora, int(w.interleave)
    a.w_qa, a.b_qa, a.n_qa = w.q_a.data_ptr(), _ptr(w.q_a_bias), w.q_a_norm.data_ptr()
    a.w_qb, a.w_kva = w.q_b.data_ptr(), w.kv_a.data_ptr()
    a.b_kva, a.n_kva = _ptr(w.kv_a_bias), w.kv_a_norm.data_ptr()
    a.eps_qa, a.eps_kva = w.q_a_eps, w.kv_a_eps
    ix = w.indexer
    if ix is not None:
        a.i_heads, a.i_dim, a.i_interleave = ix.heads, ix.head_dim, int(ix.interleave)
        a.w_iq, a.w_ik, a.w_iw = ix.wq_b.data_ptr(), ix.wk.data_ptr(), ix.weights_proj.data_ptr()
        a.ln_w, a.ln_b = ix.k_norm_weight.data_ptr(), ix.k_norm_bias.data_ptr()
        a.eps_ln, a.iw_scale = ix.k_norm_eps, ix.heads**-0.5
    return a


def run(a: _Args, x, cos, sin, slots, kv_store, idx_store, threads: int):
    """One step through prepared arguments `a` (inputs that step_ok takes) -> (q, q_rot, iq, iw)
    as `project` returns them; the cache rows written. Fills a's step fields in place."""
    lib = _kernel.get()
    T, h = x.shape[0], a.heads
    q = torch.empty(T, h, a.nope + a.rope, dtype=torch.bfloat16)
    q_rot = torch.empty(T, h, a.rope, dtype=torch.bfloat16)
    a.T, a.x, a.cos, a.sin, a.slots = (
        T,
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
    )
    a.n_slots, a.kv_store = kv_store.shape[0], kv_store.data_ptr()
    a.kv_bf16 = int(kv_store.dtype == torch.bfloat16)
    a.q, a.q_rot = q.data_ptr(), q_rot.data_ptr()
    iq = iw = None
    if a.i_heads:
        iq = torch.empty(T, a.i_heads, a.i_dim, dtype=torch.bfloat16)
        iw = torch.empty(T, a.i_heads, dtype=torch.float32)
        a.idx_kind = index_q8.KERNEL_KINDS[idx_store.dtype]
        a.idx_store, a.iq, a.iw = idx_store.data_ptr(), iq.data_ptr(), iw.data_ptr()
    rc = lib.mla_project(ctypes.byref(a), threads)
    if rc == -3:
        raise IndexError(f"mla_project: a slot of {slots.tolist()} is outside the cache's rows")
    if rc != 0:
        raise MemoryError("mla_project: no memory for its scratch")
    return q, q_rot, iq, iw


def project(x, w, cos, sin, slots, kv_store, idx_store):
    """ops/mla_project.py's contract (w: its ProjectWeights, read by field); None when not
    taken."""
    if _kernel.get() is None or not step_ok(x, w, cos, sin, slots, kv_store, idx_store):
        return None
    if not weights_ok(w):
        return None
    return run(prepare(w), x, cos, sin, slots, kv_store, idx_store, torch.get_num_threads())
