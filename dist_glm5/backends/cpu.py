"""CPU backend: the reference. Plain torch, gloo between processes, and per hot op the fastest
exact method on this CPU: the packed MXFP4 kernel (reference fallback when it cannot build) and
torch.topk selection; the other ops are the references themselves."""

from __future__ import annotations

import dataclasses
import functools

from . import Backend


@functools.cache
def cpu_ops():
    from dist_glm5.kernels import dsa_select
    from dist_glm5.ops import reference_ops
    from dist_glm5.ops.experts import cpu_experts_ops
    from dist_glm5.ops.topk import select_topk_sorted

    experts = cpu_experts_ops()
    fused = dsa_select.available()  # else: score + select + list in torch, as the reference
    return dataclasses.replace(
        reference_ops(),
        name=f"cpu({experts.name})",
        experts=experts,
        select_topk=select_topk_sorted,
        select_rows=dsa_select.select_rows if fused else None,
    )


def load() -> Backend:
    return Backend(name="cpu", device="cpu", dist_backend="gloo", ops=cpu_ops)
