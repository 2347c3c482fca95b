"""Routed experts on Gaudi through the native MoE ops, with the seam's signature (ops/experts.py).

MXFP4: `torch.ops.hpu.mixture_of_experts.mxfp4_fused_weights` takes per-expert tensor LISTS; we
pass views of our stacked serving buffers (w13 [E, 2I, H/2] u8 rows [gate; up], w2 [E, H, I/2],
E8M0 scales [.., /32]), built once per buffer and cached, never copies. Ids go as int32 GLOBAL
ids, router weights in x's dtype, and experts_min/max is this rank's INCLUSIVE range. The op is
blocked in eager mode, so outside lazy mode it runs in a `torch.compile(backend="hpu_backend")`
region; in lazy mode it is called directly (skipped only for eager by the bridge's own test: to be
confirmed on the first run, gaudi.md section 10 item 1).

Dense (bf16/fp32 experts): `mixture_of_experts.fused_weights`, in slices of at most 64 experts
(vllm-gaudi's limit for bridge 1.20) with a mark_step between slices in lazy mode.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from dist_glm5.ops.experts import ExpertsOps

from . import _hf, runtime

MXFP4_BLOCK = 32
MAX_EXPERTS_PER_SLICE = 64
ACTIVATION = "silu"  # GLM-5 experts: down(silu(gate(x)) * up(x))

# id(buffer) -> (weakref to it, its per-expert views); views of the same storage, built once
_VIEWS: dict[int, tuple[weakref.ref, tuple[Tensor, ...]]] = {}


def expert_views(t: Tensor) -> tuple[Tensor, ...]:
    """Per-expert views t[0], t[1], ... of a stacked [E, ...] buffer, cached per buffer."""
    hit = _VIEWS.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    for k in [k for k, (ref, _) in _VIEWS.items() if ref() is None]:
        del _VIEWS[k]
    views = tuple(t.unbind(0))
    _VIEWS[id(t)] = (weakref.ref(t), views)
    return views


def _check_range(w: Tensor, experts_min: int, experts_max: int) -> None:
    if experts_max - experts_min + 1 != w.shape[0]:
        raise ValueError(
            f"expert range {experts_min}..{experts_max} (inclusive) does not match the "
            f"{w.shape[0]} local experts held: pass experts_max = experts_min + E_local - 1"
        )


def _mxfp4_call(x, ids, weights, w13, w2, s13, s2, experts_min: int, experts_max: int):
    return torch.ops.hpu.mixture_of_experts.mxfp4_fused_weights(
        x,
        ids,
        weights,
        w13,
        w2,
        s13,
        s2,
        block_size=MXFP4_BLOCK,
        permuted_weights=True,  # nn.Linear [out, in] layout: what our buffers are
        activation=ACTIVATION,
        experts_min=experts_min,
        experts_max=experts_max,
        is_fp4=True,
        chunk_size=0,  # perf knob (vllm-gaudi: VLLM_MOE_CHUNK); 0 until measured on Gaudi 2
        total_experts=0,
    )


_COMPILED: dict[str, object] = {}


def _region(name: str, fn):
    """fn as a compiled region (not lazy) or itself (lazy), built once per process and mode."""
    key = f"{name}:{_hf.is_lazy()}"
    if key not in _COMPILED:
        _COMPILED[key] = runtime.compile_region(fn)
    return _COMPILED[key]


def experts_mxfp4(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    experts_min: int,
    experts_max: int,
) -> Tensor:
    """Same contract as ops.experts.experts_mxfp4_reference: [T, H] in x.dtype, this rank's
    experts only."""
    _check_range(w13, experts_min, experts_max)
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"MXFP4 experts must be packed uint8, got {w13.dtype}/{w2.dtype}")
    fn = _region("mxfp4", _mxfp4_call)
    return fn(
        x,
        topk_ids.to(torch.int32),
        topk_weights.to(x.dtype),
        expert_views(w13),
        expert_views(w2),
        expert_views(w13_scale),
        expert_views(w2_scale),
        experts_min,
        experts_max,
    )


def _dense_call(x, ids, weights, w13, w2, experts_min: int, experts_max: int):
    return torch.ops.hpu.mixture_of_experts.fused_weights(
        x, ids, weights, w13, w2, True, ACTIVATION, experts_min, experts_max
    )


def experts_dense(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    experts_min: int,
    experts_max: int,
) -> Tensor:
    """Same contract as ops.experts.experts_dense_reference."""
    _check_range(w13, experts_min, experts_max)
    ids, weights = topk_ids.to(torch.int32), topk_weights.to(x.dtype)
    v13, v2 = expert_views(w13), expert_views(w2)
    fn = _region("dense", _dense_call)
    out = None
    for a in range(0, len(v13), MAX_EXPERTS_PER_SLICE):
        b = min(len(v13), a + MAX_EXPERTS_PER_SLICE)
        y = fn(x, ids, weights, v13[a:b], v2[a:b], experts_min + a, experts_min + b - 1)
        out = y if out is None else out + y
        if b < len(v13):
            runtime.mark_step()
    return out


HPU_EXPERTS = ExpertsOps("hpu-native", experts_mxfp4, experts_dense)
