"""CPU backend: the reference. Plain torch, gloo between processes, and per hot op the fastest
exact method on this CPU: the packed MXFP4 kernel and the fused DSA selection (reference
fallbacks when they cannot build), torch.topk selection, a decode step's few-row bf16 products,
norms, ropes, a layer's projections and sparse attention in C, and larger bf16 products in fp32
on CPUs without bf16 GEMM instructions; the other ops are the references themselves."""

from __future__ import annotations

import dataclasses
import functools

from . import Backend


@functools.cache
def cpu_ops():
    from dist_glm5.kernels import (
        bf16_gemv,
        dsa_select,
        mla_decode,
        mla_project,
        norm_rope,
        router,
    )
    from dist_glm5.ops import attention, linear, reference_ops
    from dist_glm5.ops.experts import cpu_experts_ops
    from dist_glm5.ops.topk import select_topk_sorted

    from . import cpu_plan

    ref = reference_ops()
    wide = not linear.native_bf16_gemm()  # bf16 GEMMs in fp32 (ops/linear.py says why)
    prod = linear.linear_fp32_gemm if wide else ref.linear
    gemv = bf16_gemv.available()  # a decode step's few bf16 rows in C (ops/linear.py)
    if gemv:
        prod = functools.partial(bf16_gemv.linear, fallback=prod)
    experts = cpu_experts_ops(prod) if prod is not ref.linear else cpu_experts_ops()
    if gemv:  # a few tokens' bf16 experts in one C call, not a Python loop over experts
        experts = dataclasses.replace(
            experts, dense=functools.partial(bf16_gemv.experts, fallback=experts.dense)
        )
    fused = dsa_select.available()  # else: score + select + list in torch, as the reference
    small = norm_rope.available()  # a decode step's norms and ropes in one C call each
    einsum = linear.einsum_fp32_gemm if wide else ref.einsum
    # the sparse decode's torch form, with this backend's products
    decode = functools.partial(attention.absorbed_gathered, einsum=einsum)
    if mla_decode.available():  # one C call per layer
        decode = functools.partial(mla_decode.absorbed_gathered, fallback=decode)
    return dataclasses.replace(
        ref,
        name=f"cpu({experts.name}{', fp32 GEMM' if wide else ''}{', bf16 GEMV' if gemv else ''})",
        experts=experts,
        select_topk=select_topk_sorted,
        select_rows=dsa_select.select_rows if fused else None,
        select_many=dsa_select.select_many if fused else None,
        linear=prod,
        einsum=einsum,
        absorbed_gathered=decode,
        rms_norm=functools.partial(norm_rope.rms_norm, fallback=ref.rms_norm)
        if small
        else ref.rms_norm,
        apply_rope=functools.partial(norm_rope.apply_rope, fallback=ref.apply_rope)
        if small
        else ref.apply_rope,
        # a decode step's projections, norms, ropes and cache writes in one C call per layer
        # (products, norms and ropes the C kernels above compute; needs them)
        mla_project=mla_project.project if gemv and small and mla_project.available() else None,
        # a decode step's router in one C call (model/router.route, its fallback, beyond it)
        route=router.route if router.available() else None,
        # a decode step's layers as these kernels in sequence, arguments prepared once (the
        # modules run what it declines)
        decode_plan=cpu_plan.plan,
    )


def load() -> Backend:
    return Backend(name="cpu", device="cpu", dist_backend="gloo", ops=cpu_ops)
