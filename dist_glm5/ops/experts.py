"""The routed-experts op: the seam between the model and the kernels, chosen once per backend.

The interface is the Gaudi op's (shared/gaudi.md section 1), so the hpu backend plugs in as it is:

    experts_mxfp4(x [T, H], topk_ids [T, k] int32 GLOBAL ids, topk_weights [T, k],
                  w13 [E, 2I, H/2] u8, w13_scale [E, 2I, H/32] u8, w2 [E, H, I/2] u8,
                  w2_scale [E, H, I/32] u8, experts_min, experts_max) -> [T, H] in x.dtype
    experts_dense(x, topk_ids, topk_weights, w13 [E, 2I, H], w2 [E, H, I],
                  experts_min, experts_max) -> [T, H]

Both return the sum over THIS rank's experts only (ids outside the inclusive range
experts_min..experts_max contribute nothing; the caller sums over ranks). w13 rows per expert are
[gate; up]. The references below wrap `experts_reference`, the plain loop every fast op is
tested against. MXFP4 accumulates in fp32 whatever x's dtype (as the kernels do).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, linear=F.linear) -> torch.Tensor:
    # x: [n, H], w13: [2I, H] ([gate; up]), w2: [H, I] -> [n, H]; linear: the backend's product
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


def experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert_weights,
    first_expert: int,
    num_local: int,
    linear=F.linear,
) -> torch.Tensor:
    """x: [T, H], weights/ids: [T, k] -> [T, H], the sum over this rank's experts only.

    expert_weights(e_local) -> (w13 [2I, H], w2 [H, I]) in x's dtype (decoded if quantised).
    linear: the backend's product (ops/linear.py).
    """
    out = torch.zeros_like(x)
    local = ids.long() - first_expert
    hit = (local >= 0) & (local < num_local)
    for e in torch.unique(local[hit]).tolist():  # ascending id order, as the reference model
        tok, slot = torch.where(local == e)
        w13, w2 = expert_weights(e)
        y = swiglu(x[tok], w13, w2, linear) * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def experts_dense_reference(
    x, topk_ids, topk_weights, w13, w2, experts_min, experts_max, linear=F.linear
):
    return experts_reference(
        x,
        topk_weights,
        topk_ids,
        lambda e: (w13[e], w2[e]),
        experts_min,
        experts_max - experts_min + 1,
        linear,
    )


def experts_mxfp4_reference(
    x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, experts_min, experts_max
):
    """Dequantise each touched expert to fp32 with our codec, then the loop in fp32 (the 'stock
    op': every touched expert unpacked in memory before small GEMMs)."""
    from dist_glm5.quant.mxfp4 import decode

    def weights(e):
        f32 = torch.float32
        return decode(w13[e], w13_scale[e], f32), decode(w2[e], w2_scale[e], f32)

    y = experts_reference(
        x.float(),
        topk_weights.float(),
        topk_ids,
        weights,
        experts_min,
        experts_max - experts_min + 1,
    )
    return y.to(x.dtype)


@dataclass(frozen=True)
class ExpertsOps:
    name: str
    mxfp4: Callable[..., Tensor]
    dense: Callable[..., Tensor]


REFERENCE = ExpertsOps("reference", experts_mxfp4_reference, experts_dense_reference)


def cpu_experts_ops(linear=F.linear) -> ExpertsOps:
    """The CPU backend's choice: the packed MXFP4 kernel (kernels/mxfp4_moe.c) when it builds
    here, else the reference, said once in the log; float experts multiply with `linear` (the
    backend's product, ops/linear.py). DIST_GLM5_EXPERTS=w4a8 opts into the int8-activation
    kernel (kernels/mxfp4_w4a8.py: faster, about 1% relative error per MoE layer)."""
    from dist_glm5.kernels import mxfp4_moe

    dense = (
        experts_dense_reference
        if linear is F.linear
        else functools.partial(experts_dense_reference, linear=linear)
    )
    if not mxfp4_moe.available():
        log.warning(
            "MXFP4 MoE kernel unavailable: routed experts run the reference "
            "(dequantise-then-GEMM) path"
        )
        if dense is experts_dense_reference:
            return REFERENCE
        return ExpertsOps("reference", experts_mxfp4_reference, dense)
    choice = os.environ.get("DIST_GLM5_EXPERTS", "exact")
    if choice == "w4a8":  # opt-in: int8 activations, ~1% relative error (kernels/mxfp4_w4a8.py)
        from dist_glm5.kernels import mxfp4_w4a8

        if not mxfp4_w4a8.available():
            raise RuntimeError(
                "DIST_GLM5_EXPERTS=w4a8 but the w4a8 kernel does not build here (see the build "
                "warning); unset it for the exact kernel"
            )
        return ExpertsOps("cpu-w4a8", mxfp4_w4a8.moe_mxfp4_w4a8, dense)
    if choice != "exact":
        raise ValueError(f"DIST_GLM5_EXPERTS={choice!r}: use 'exact' (the default) or 'w4a8'")
    return ExpertsOps("cpu-kernel", mxfp4_moe.moe_mxfp4, dense)
