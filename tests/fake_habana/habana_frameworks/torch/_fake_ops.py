"""The native MoE ops, registered with torch.library, computed by an independent CPU reference.

The MXFP4 decode here is written from the OCP spec, not taken from the project's codec:
E2M1 codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign, element 2j in the LOW nibble; one
E8M0 scale byte per 32 elements along the input dim, value 2^(byte-127) (byte 255 is NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import record

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_SCHEMA_MXFP4 = (
    "mixture_of_experts.mxfp4_fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor[] w12, Tensor[] w3, Tensor[] d_scale_w12, Tensor[] d_scale_w3, "
    "*, int block_size, bool permuted_weights, str activation, int experts_min, int experts_max, "
    "bool is_fp4, int chunk_size, int total_experts) -> Tensor"
)
# Without defaults every flag must be passed (every known call site passes them all) and reaches
# the recording impl: the dispatcher drops keyword arguments equal to a schema default.
# the bf16 op's registered schema (gaudi-pytorch-bridge habana_kernels/kernels_register.cpp)
_SCHEMA_BF16 = (
    "mixture_of_experts.fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor[] w12, Tensor[] w3, bool permuted_weights, str activation, "
    "int experts_min, int experts_max) -> Tensor"
)
_LIB = None


def dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [R, K/2] u8, scale [R, K/32] u8 -> [R, K] fp64."""
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64)
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).long()
    vals = table[codes]
    s = torch.pow(2.0, scale.double() - 127.0)
    s = torch.where(scale == 255, torch.full_like(s, float("nan")), s)
    return (vals.view(vals.shape[0], -1, 32) * s[..., None]).reshape(vals.shape)


def _moe(x, ids, weights, w12, w3, experts_min, experts_max, activation):
    act = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation]
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for j, e in enumerate(range(experts_min, experts_max + 1)):
        w1, w2 = w12[j]  # [I, H] each: gate rows first, then up ([gate; up], not interleaved)
        for t in range(x.shape[0]):
            for s in range(ids.shape[1]):
                if int(ids[t, s]) == e:
                    h = act(xd[t] @ w1.T) * (xd[t] @ w2.T)
                    out[t] += float(weights[t, s]) * (h @ w3[j].T)
    return out.to(x.dtype)


def _check_common(x, ids, weights, n12, n3, experts_min, experts_max):
    assert ids.dtype == torch.int32, f"expert_routing_table must be int32, got {ids.dtype}"
    assert weights.dtype == x.dtype, f"router_weights {weights.dtype} != hidden {x.dtype}"
    n = experts_max - experts_min + 1
    assert n12 == n3 == n, f"{n12}/{n3} expert tensors for the range {experts_min}..{experts_max}"


def mxfp4_fused_weights(
    hidden_states,
    expert_routing_table,
    router_weights,
    w12,
    w3,
    d_scale_w12,
    d_scale_w3,
    block_size=32,
    permuted_weights=True,
    activation="silu",
    experts_min=0,
    experts_max=0,
    is_fp4=True,
    chunk_size=0,
    total_experts=0,
):
    x, ids, weights = hidden_states, expert_routing_table, router_weights
    _check_common(x, ids, weights, len(w12), len(w3), experts_min, experts_max)
    assert block_size == 32 and permuted_weights and is_fp4
    assert all(w.dtype == torch.uint8 for w in [*w12, *w3, *d_scale_w12, *d_scale_w3])
    a = [dequant(w, s) for w, s in zip(w12, d_scale_w12)]
    b = [dequant(w, s) for w, s in zip(w3, d_scale_w3)]
    return _moe(
        x, ids, weights, [w.chunk(2, 0) for w in a], b, experts_min, experts_max, activation
    )


def fused_weights(
    hidden_states,
    expert_routing_table,
    router_weights,
    w12,
    w3,
    permuted_weights,
    activation,
    experts_min,
    experts_max,
):
    x, ids, weights = hidden_states, expert_routing_table, router_weights
    _check_common(x, ids, weights, len(w12), len(w3), experts_min, experts_max)
    assert permuted_weights
    w12d = [w.double().chunk(2, 0) for w in w12]
    return _moe(
        x, ids, weights, w12d, [w.double() for w in w3], experts_min, experts_max, activation
    )


def _recording(name, fn):
    def impl(*args, **kwargs):
        record(name, *args, **kwargs)
        return fn(*args, **kwargs)

    return impl


def _hpu_backend(gm, example_inputs):
    record("compile.hpu_backend", gm)
    return gm.forward


def register() -> None:
    """Once per process: the library outlives re-imports of this fake (tests purge it from
    sys.modules between files), so it is kept on torch itself."""
    global _LIB
    _LIB = getattr(torch, "_fake_habana_lib", None)
    if _LIB is not None:
        return
    _LIB = torch._fake_habana_lib = torch.library.Library("hpu", "FRAGMENT")
    for schema, overload, fn in (
        (_SCHEMA_MXFP4, "mxfp4_fused_weights", mxfp4_fused_weights),
        (_SCHEMA_BF16, "fused_weights", fused_weights),
    ):
        qual = f"mixture_of_experts.{overload}"
        _LIB.define(schema)
        _LIB.impl(qual, _recording(f"moe.{overload}", fn), "CPU")
        torch.library.register_fake(f"hpu::{qual}", lib=_LIB)(
            lambda hidden_states, *a, **k: torch.empty_like(hidden_states)
        )
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "hpu_backend" not in _BACKENDS:
        register_backend(_hpu_backend, name="hpu_backend")
