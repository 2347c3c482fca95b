"""The DSA indexer scan + exact top-k for query rows of one sequence, in C (kernels/dsa_select.c);
`select_many` for the rows of a decode batch's sequences in one call.

`select_rows(q, w, idx_store, keys, q_pos, topk, head_dim)` -> (keep [n, L] bool, slots [n, k],
valid [n, k]): the same contract as scoring with `ops/indexer.index_scores` in capped chunks,
selecting with `ops/topk.select_topk_*` and listing with `model/dsa.selected_slots`, which stay
the reference beside it. Decode (a few rows over a long context) reads each index key once instead
of five passes; prefill (many rows) scores at the GEMM rate and selects in two passes per row, with
no [rows, keys] masks. `available()` is False when the kernel cannot build or DIST_GLM5_KERNELS=0;
callers then take the torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

from dist_glm5.quant import index_q8

from .build import Lazy

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("dsa_select.c")

_scratch = threading.local()  # per thread: the scores buffer, kept between calls


def _signatures(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.dsa_select.argtypes = [p, p, i, i, i, p, i, p, i, i64, p, i, p, p, p, p, p, i]
    lib.dsa_select.restype = i
    lib.dsa_select_many.argtypes = [p, p, i, p, i, i, p, i, p, p, i, p, p, i, p, p, i]
    lib.dsa_select_many.restype = i
    lib.dsa_select_portable.argtypes = [i]
    lib.dsa_select_portable.restype = None
    lib.dsa_select_q8_vnni.argtypes = [i]
    lib.dsa_select_q8_vnni.restype = i
    lib.dsa_select_q8_amx.argtypes = [i, i]
    lib.dsa_select_q8_amx.restype = i
    lib.dsa_select_no_amx.argtypes = [i]
    lib.dsa_select_no_amx.restype = None
    lib.dsa_select_bf16dot.argtypes = [i]
    lib.dsa_select_bf16dot.restype = i
    lib.dsa_select_quantise.argtypes = [p, i64, i, p, p]
    lib.dsa_select_quantise.restype = None
    lib.dsa_select_vnni_spin.argtypes = [i64]
    lib.dsa_select_vnni_spin.restype = i64


_kernel = Lazy(SOURCE, _signatures)

available = _kernel.available


def _scores(n: int, L: int) -> torch.Tensor:
    """A [n, L] fp32 buffer from this thread's scratch: a long prefill calls once per layer with
    the same size, and faulting in a fresh buffer each time cost a third of the call here (page
    faults at about 0.7 GB/s in this VM). Held until a larger one is needed (the planner's score
    term)."""
    buf = getattr(_scratch, "scores", None)
    if buf is None or buf.numel() < n * L:
        _scratch.scores = buf = None  # free the old one before the new one faults in
        # 1/8 more than asked: a prefill's context grows by a chunk per call, and a buffer sized
        # exactly would be reallocated (and faulted in: 0.16 s at 128K here) on every call
        _scratch.scores = buf = torch.empty(n * L + n * L // 8, dtype=torch.float32)
    return buf[: n * L].view(n, L)


class _Inputs(NamedTuple):
    q: torch.Tensor  # [n, Hi, D] fp32 (int8 keys: the kernel quantises them, as index_q8.quantise)
    w: torch.Tensor  # [n, Hi] fp32, scaled by D**-0.5
    store: torch.Tensor
    kind: int


def _inputs(lib, q, w, idx_store, head_dim: int) -> _Inputs:
    """What both entry points hand the kernel."""
    if lib is None or idx_store.dtype not in index_q8.KERNEL_KINDS:
        raise RuntimeError("dsa_select kernel unavailable: use the torch path")
    qf = q.float().contiguous()
    wf = (w.float() * head_dim**-0.5).contiguous()
    store = idx_store if idx_store.is_contiguous() else idx_store.contiguous()
    return _Inputs(qf, wf, store, index_q8.KERNEL_KINDS[idx_store.dtype])


def quantise(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own quantisation of int8-key queries, q [..., D] fp32 -> (values [..., D] as
    fp32, scales [...]): index_q8.quantise's (the tests compare them)."""
    q = q.float().contiguous()
    qv, qs = torch.empty_like(q), torch.empty(q.shape[:-1])
    _kernel.get().dsa_select_quantise(
        q.data_ptr(), qs.numel(), q.shape[-1], qv.data_ptr(), qs.data_ptr()
    )
    return qv, qs


def force_portable(on: bool) -> None:
    """Take the portable path even where AVX-512 VNNI (int8 keys) or AVX512-BF16 (bf16 keys) is
    (tests compare the paths)."""
    _kernel.get().dsa_select_portable(int(on))


def force_no_amx(on: bool) -> None:
    """Score int8 keys with AVX-512 VNNI even where AMX is (tests compare the paths)."""
    _kernel.get().dsa_select_no_amx(int(on))


@contextlib.contextmanager
def int8_path(path: str):
    """Within it, int8 keys take `path` ("amx", "vnni" or "portable") where this CPU has it (the
    tests and `bench index-scan` run the paths on the same keys); the default choice after."""
    force_portable(path == "portable")
    force_no_amx(path != "amx")
    try:
        yield
    finally:
        force_portable(False)
        force_no_amx(False)


def uses_vnni(head_dim: int) -> bool:
    """Whether int8 keys of this width are scored with AVX-512 VNNI (or AMX) here."""
    return bool(_kernel.get().dsa_select_q8_vnni(head_dim))


def uses_amx(head_dim: int, heads: int = 16) -> bool:
    """Whether int8 keys of this width, with this many indexer heads, are scored with AMX here
    (decode rows: more than 8 rows of over 8 heads of under 64 bytes take VNNI, kernels/
    dsa_select.c's scan says why)."""
    return bool(_kernel.get().dsa_select_q8_amx(head_dim, heads))


def uses_bf16dot(head_dim: int) -> bool:
    """Whether bf16 keys of this width (with bf16-valued queries) are scored with AVX512-BF16."""
    return bool(_kernel.get().dsa_select_bf16dot(head_dim))


def vnni_rate(seconds: float = 0.02, repeats: int = 5) -> float:
    """vpdpbusd (zmm: 64 int8 products) this thread issues a second, the best of `repeats` runs
    of about `seconds` each; 0.0 where int8 keys do not take the VNNI path. An int8 key-row of
    Hi heads x D bytes needs Hi * D / 64 of them: the scan's arithmetic floor."""
    lib = _kernel.get()
    if lib is None or not lib.dsa_select_vnni_spin(1):
        return 0.0
    iters, best = 1 << 16, float("inf")
    t = time.perf_counter()
    lib.dsa_select_vnni_spin(iters)
    iters = max(1, int(iters * seconds / max(time.perf_counter() - t, 1e-6)))
    for _ in range(repeats):
        t = time.perf_counter()
        n = lib.dsa_select_vnni_spin(iters)
        best = min(best, time.perf_counter() - t)
    return n / best


def select_rows(q, w, idx_store, keys, q_pos, topk: int, head_dim: int, keep=None, mask=True):
    """q [n, Hi, D], w [n, Hi] fp32, idx_store [S, D] (bf16 or fp32, or int8 rows [S, D + 4]),
    keys: KeySlots of the sequence, q_pos [n] -> (keep [n, L], slots [n, k], valid [n, k]),
    k = min(topk, L). keep: an all-False [n, L] bool block to fill (a row block of the caller's
    mask), else a new one; mask=False: no mask at all (keep is None), for callers that attend by
    the slots."""
    lib = _kernel.get()
    n, H, D = q.shape
    L = len(keys)
    k = min(topk, L)
    a = _inputs(lib, q, w, idx_store, head_dim)
    table = keys.table.to(torch.int64).contiguous()
    qp = q_pos.to(torch.int64).contiguous()
    scores = _scores(n, L)
    pos = torch.empty(n, k, dtype=torch.int64)
    cnt = torch.empty(n, dtype=torch.int32)
    slots = torch.empty(n, k, dtype=torch.int64)
    valid = torch.empty(n, k, dtype=torch.bool)
    rc = lib.dsa_select(
        a.q.data_ptr(),
        a.w.data_ptr(),
        n,
        H,
        D,
        a.store.data_ptr(),
        a.kind,
        table.data_ptr(),
        keys.block_size,
        L,
        qp.data_ptr(),
        k,
        scores.data_ptr(),
        pos.data_ptr(),
        cnt.data_ptr(),
        slots.data_ptr(),
        valid.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"dsa_select failed ({rc}): index_head_dim {D} > 256, or out of memory")
    if mask:
        if keep is None:
            keep = torch.zeros(n, L, dtype=torch.bool)
        keep.scatter_(1, pos, True)  # padding repeats a kept position
    return keep, slots, valid


def select_many(q, w, idx_store, rows, topk: int, head_dim: int):
    """select_rows for the rows of several sequences in one call: q [R, Hi, D], w [R, Hi], rows
    (ops/key_slots.RowsKeys: each sequence's rows, positions and keys) -> (slots, valid
    [R, topk]); a sequence with fewer than topk keys has its picks then padding (the first pick's
    slot, not valid), as select_rows' slots padded to topk."""
    lib = _kernel.get()
    R, H, D = q.shape
    a = _inputs(lib, q, w, idx_store, head_dim)
    slots = torch.empty(R, topk, dtype=torch.int64)
    valid = torch.empty(R, topk, dtype=torch.bool)
    rc = lib.dsa_select_many(
        a.q.data_ptr(), a.w.data_ptr(), len(rows.lengths), rows.row_off.data_ptr(), H, D,
        a.store.data_ptr(), a.kind, rows.tables.data_ptr(),
        rows.tab_off.data_ptr(), rows.block_size, rows.lengths.data_ptr(), rows.q_pos.data_ptr(),
        topk, slots.data_ptr(), valid.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"dsa_select_many failed ({rc}): index_head_dim {D} > 256, or no memory")
    return slots, valid
