"""Gaudi 2 backend: the only package that imports habana_frameworks, and only when chosen.

`load()` applies the bridge's environment defaults (only where unset), imports the stack (the
clear RuntimeError of `_hf.MISSING` on machines without it) and returns the Backend whose ops are
the Gaudi implementations: routed experts through the native MXFP4 MoE op, int32-safe bisection
top-k and index scores, FusedSDPA / absorbed / gathered attention, fused RMSNorm and RoPE, each with
its CPU reference's signature. Its `comm` is HcclComm on the device, its `stage` the per-stage
runtime of stage.py (device placement, step padding to buckets, warm-up).
"""

from __future__ import annotations

import functools

from dist_glm5.backends import Backend

from . import _hf, env


@functools.cache
def hpu_ops():
    import dataclasses

    from dist_glm5.ops import attention as ref_attention
    from dist_glm5.ops import reference_ops

    from . import attention, indexer, norm_rope
    from .moe import HPU_EXPERTS

    return dataclasses.replace(
        reference_ops(),
        name="hpu",
        experts=HPU_EXPERTS,
        select_topk=indexer.select_topk,
        index_scores=indexer.index_scores,
        mla_expanded=attention.mla_expanded,
        mla_absorbed=attention.mla_absorbed,
        attend_absorbed_chunked=attention.attend_absorbed_chunked,
        absorbed_gathered=functools.partial(
            ref_attention.absorbed_gathered, attend=attention.attend_gathered
        ),
        rms_norm=norm_rope.rms_norm,
        apply_rope=norm_rope.apply_rope,
    )


def load() -> Backend:
    env.apply_defaults()
    device = env.device()
    _hf.core()  # registers the 'hpu' device and the native ops with torch
    return Backend(
        name="hpu",
        device=device,
        dist_backend="hccl",
        ops=hpu_ops,
        comm=functools.partial(_comm, device=device),
        stage=functools.partial(_stage, device=device),
    )


def _comm(stage: int, rank: int, stages: int, ranks: int, init_method: str, device: str):
    from .comm import HcclComm

    return HcclComm(stage, rank, stages, ranks, init_method, device=device)


def _stage(model, device: str, **kw):
    from .stage import HpuStage

    return HpuStage(model, device, **kw)
