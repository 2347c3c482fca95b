"""The native MoE ops, registered with torch.library, computed by an independent CPU reference.

Each semantic is traced to a caller of the real op, not to our own reading. Sources (gaudi.md §0):
  PBt  Habana's bridge test "Tests for hpu::mixture_of_experts.mxfp4 and
       hpu::mixture_of_experts.mxfp4_fused_weights" (Intel 2026; gaudi.md §1b): its helpers
       quantize_mxfp4 / dequantize_mxfp4_weight, its CPU reference MixtralBlockSparseMLP /
       MixtralSparseMoeBlock, and test_mixture_of_experts_mxfp4_fused_weights.
  VG   vllm-project/vllm-gaudi @ 091bbadd: vllm_gaudi/extension/ops.py, ops/hpu_mxfp4.py.
  PB   HabanaAI/gaudi-pytorch-bridge @ 5a56187 (1.19.0): hpu_ops/backend/mixture_of_experts.cpp
       (the bf16 op; 1.19 has no mxfp4 op).
Marks as in gaudi.md: [src] read in the source, [inferred] follows from a caller that depends on
it, [unconfirmed] no source settles it (the fake picks a reading and says which).

Refusals: `_refuse` (RuntimeError, like the bridge's TORCH_CHECK) only where a source says the
real op cannot do it; `_contract` (AssertionError) where every caller does one thing and no
source says whether the op would refuse the other: those pin our calls to the callers' form.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import record

# [src] PBt `_FP4_VALUES`: E2M1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same
# magnitudes negated (bit 3 the sign).
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# [src] PBt module docstring: "Group size is fixed to 32 by the TPC kernel
# cast_packed_mxfp4_to_bf16"; VG hpu_mxfp4.py `MXFP4_BLOCK_SIZE = 32`.
_GROUP = 32
# [src] PB mixture_of_experts.cpp activationModeMap {gelu, relu, silu}; anything else fails its
# TORCH_CHECK ("not found among MoeActivationMode_t enum values"). That map is the bf16 op's;
# that the mxfp4 overloads share it is [inferred] (same kernel family, same params struct); PBt
# tests the mxfp4 ops with "silu" only (ACTIVATIONS = ["silu"]).
# [src] VG ops.py:44-47: "The Gaudi gelu TPC kernel already uses the tanh approximation", so
# gelu here is the tanh form.
_ACT = {
    "silu": F.silu,
    "gelu": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}
_SCHEMA_MXFP4 = (
    "mixture_of_experts.mxfp4_fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor[] w12, Tensor[] w3, Tensor[] d_scale_w12, Tensor[] d_scale_w3, "
    "*, int block_size, bool permuted_weights, str activation, int experts_min, int experts_max, "
    "bool is_fp4, int chunk_size, int total_experts) -> Tensor"
)
# The real schema text is [unconfirmed] (not public). It has defaults at least for chunk_size
# and total_experts: PBt's test_mixture_of_experts_mxfp4_output_dtype calls without them. Here
# every flag is required, so that what we pass reaches the recording impl (the dispatcher drops
# keyword arguments equal to a schema default).
# [src] the bf16 op's registered schema (PB habana_kernels/kernels_register.cpp:2468)
_SCHEMA_BF16 = (
    "mixture_of_experts.fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor[] w12, Tensor[] w3, bool permuted_weights, str activation, "
    "int experts_min, int experts_max) -> Tensor"
)
_LIB = None
# Depth of compiled-graph runs (the fake hpu_backend's), kept on torch like RECORD: the op impl
# and the backend registered by a first import outlive re-imports of this fake.
_GRAPH = torch.__dict__.setdefault("_fake_habana_graph_depth", [0])


def _refuse(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(f"[fake hpu] {msg}")


def _contract(ok: bool, msg: str) -> None:
    assert ok, f"[fake hpu] {msg} (every known caller does this; the real op's rule is unknown)"


def dequant(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """packed [R, ceil(cols/2)] u8, scale [R, ceil(cols/32)] u8 -> [R, cols] fp64."""
    # [src] shapes: PBt docstring "Shape of packed tensor: (rows, ceil(cols / 2))", scales
    # "(rows, ceil(cols / 32))"; VG ops.py:1561,1565 set_weight/set_scale say the same. A
    # mismatch cannot be a valid GEMM operand [inferred].
    _refuse(packed.dtype == scale.dtype == torch.uint8, "MXFP4 weights and scales are uint8")
    want = (packed.shape[0], -(-cols // 2)), (packed.shape[0], -(-cols // _GROUP))
    _refuse(
        (tuple(packed.shape), tuple(scale.shape)) == want,
        f"packed {tuple(packed.shape)} / scale {tuple(scale.shape)} for {cols} input columns: "
        f"want {want[0]} / {want[1]}",
    )
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64)
    # [src] PBt quantize_mxfp4: "Pack: 2 FP4 indices per byte (low nibble = even, high nibble =
    # odd)"; dequantize_mxfp4_weight reads `byte & 15` for an even column, `byte >> 4 & 15` odd.
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)[:, :cols].long()
    # [src] PBt e8m0_scale_to_float: "value = 2^(byte - 127)"; dequantize_mxfp4_weight takes the
    # scale of column c from group c // 32 of the same row: one scale per 32 consecutive values
    # of the INPUT dim (weights are [out, in], see permuted_weights below).
    # Byte 255: [unconfirmed]. OCP MX says NaN (so do we, and our codec); PBt's reference formula
    # gives 2^128 (inf once in bf16); what the TPC kernel does is not public.
    s = torch.pow(2.0, scale.double() - 127.0)
    s = torch.where(scale == 255, torch.full_like(s, math.nan), s)
    return table[codes] * s.repeat_interleave(_GROUP, dim=1)[:, :cols]


def _moe(x, ids, weights, gate_up, down, experts_min, experts_max, activation):
    """gate_up[j] = (gate [I, H], up [I, H]), down[j] [H, I] for global expert experts_min + j."""
    act = _ACT[activation]
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd, wd = x.double(), weights.double()
    # [inferred] ids are GLOBAL and list entry j is expert experts_min + j; a token's slots that
    # name an expert outside [experts_min, experts_max] add nothing. VG hpu_mxfp4.py:71 gives each
    # EP rank `experts_min, experts_max = ep_shift, num_experts + ep_shift - 1` with the same
    # global top-k ids on every rank, and VG ops.py:746,761 runs one routing table over expert
    # slices (`max_expert = min_expert + self.num_expert_per_group - 1`) and sums the outputs
    # (`final_hidden_states += slice_final_hidden_states`): both are right only so. PBt tests
    # experts_min=0 alone, with every id in range.
    # [src] experts_max is INCLUSIVE: PBt passes `experts_min=0, experts_max=num_experts - 1`
    # with num_experts tensors per list; VG hpu_mxfp4.py:71 and ops.py:746 likewise.
    for j, e in enumerate(range(experts_min, experts_max + 1)):
        # [src] routing weights: PBt MixtralSparseMoeBlock.forward multiplies each expert's
        # OUTPUT by the raw router weight, `expert_layer(current_state) * routing_weights[top_x,
        # idx, None]`, and sums a token's slots (index_add_). No normalisation inside the op: PBt
        # passes raw top-k values of randn (negative ones too); VG hpu_mxfp4.py:129 normalises
        # before calling (`topk_weights /= topk_weights.sum(dim=-1, keepdim=True)`).
        w = (wd * (ids == e)).sum(-1)  # [T]: a token's weight for expert e (0 if not routed)
        gate, up = gate_up[j]
        # [src] PBt MixtralBlockSparseMLP.forward: `act(x @ w1) * (x @ w2)`, then `@ w3`.
        h = act(xd @ gate.T) * (xd @ up.T)
        out += w[:, None] * (h @ down[j].T)
    # [src] output shape = hidden_states' shape (PB MixtureOfExpertsMeta); dtype: the bf16 op's
    # meta says hidden_states' dtype; PBt asserts bf16 out for the mxfp4 op with bf16 in ("Verify
    # output is always BF16 regardless of input layout"). Non-bf16 hidden states for the mxfp4 op
    # appear in no source [unconfirmed]: the fake answers in x's dtype.
    # Precision: computed in fp64 and rounded once here. The kernel's accumulation is
    # [unconfirmed]; PBt's bar is cosine similarity >= 0.9 against its bf16 reference.
    return out.to(x.dtype)


def _check_common(x, ids, weights, n12, n3, experts_min, experts_max, activation):
    _refuse(
        activation in _ACT,
        f'Activation "{activation}" not found among MoeActivationMode_t enum values.',
    )
    # VG ops.py:1710 "expert_routing_table must be int32 for the mxfp4 op" and hpu_mxfp4.py:133
    # "MXFP4 kernel requires int32 routing table"; but PBt passes torch.topk's int64 indices
    # (lazy mode would cast them to int32 on the device). So whether int64 is refused is
    # unsettled: held to the VG form.
    _contract(ids.dtype == torch.int32, f"expert_routing_table is int32, got {ids.dtype}")
    _contract(ids.dim() == 2 and ids.shape == weights.shape, "ids and weights are [T, k]")
    # VG hpu_mxfp4.py:130 `topk_weights.to(x.dtype)`; PBt's are bf16 like its hidden states.
    _contract(weights.dtype == x.dtype, f"router_weights {weights.dtype} != hidden {x.dtype}")
    # The bridge takes the expert count from the list length (PB AddNode: `num_experts =
    # stack.at(3).toTensorList().size()`) and never compares it with the range; every caller
    # passes experts_max - experts_min + 1 tensors.
    n = experts_max - experts_min + 1
    rng = f"{experts_min}..{experts_max}"
    _contract(n12 == n3 == n, f"{n12}/{n3} expert tensors for the range {rng}")


def _is_lazy() -> bool:
    from .utils.internal import is_lazy

    return is_lazy()


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
    # [src] VG ops.py:1580 "The mxfp4 ops have frontend_blocklist: [eager], meaning they can only
    # execute through the graph compilation path"; PBt skips eager mode alone ("mxfp4 op not
    # supported in eager mode (frontend_blocklist)"). Lazy mode is not skipped there, so a
    # direct call is allowed in lazy mode ([inferred], gaudi.md §10 item 1).
    _refuse(
        _is_lazy() or _GRAPH[0] > 0,
        "mxfp4_fused_weights is blocked in eager mode (frontend_blocklist: [eager]): run it "
        'under torch.compile(backend="hpu_backend") or in lazy mode',
    )
    _check_common(x, ids, weights, len(w12), len(w3), experts_min, experts_max, activation)
    _refuse(block_size == _GROUP, f"block_size {block_size}: the TPC kernel's group size is 32")
    # [src] PBt: "permuted_weights=True is required with MXFP4 (column-major layout)", i.e. every
    # weight passed as nn.Linear's [out, in] (PBt transposes its [in, out] weights first).
    _refuse(permuted_weights, "permuted_weights=True is required with MXFP4")
    # Every caller passes is_fp4=True; what False would mean is not public.
    _contract(is_fp4, "is_fp4=True")
    _contract(len(d_scale_w12) == len(w12) and len(d_scale_w3) == len(w3), "a scale per weight")
    H = x.shape[-1]
    I2 = {w.shape[0] for w in w12}
    _refuse(len(I2) == 1 and I2.pop() % 2 == 0, "w12 rows: 2 * ffn for every expert")
    I = w12[0].shape[0] // 2
    # [src] fused rows: PBt test_mixture_of_experts_mxfp4_fused_weights builds
    # `torch.cat((w1, w2), dim=0)` of the permuted weights and takes w1 = the first ffn_dim rows
    # as the activated (gate) one, w2 = the rest (up): [gate; up], halves, not interleaved.
    gate_up = [dequant(w, s, H).split(I, 0) for w, s in zip(w12, d_scale_w12)]
    # [src] w3 (down) is [hidden, ffn] permuted, packed along ffn: PBt `cols_w3 = ffn_dim`.
    down = [dequant(w, s, I) for w, s in zip(w3, d_scale_w3)]
    for d in down:
        _refuse(d.shape[0] == H, f"w3 rows {d.shape[0]} != hidden {H}")
    # chunk_size / total_experts: a performance knob (VG _get_extra_kwargs: "chunk_size is a key
    # performance tuning parameter"); PBt runs (0, 0) and (4, 8) against one reference, so the
    # result does not depend on them [src].
    return _moe(x, ids, weights, gate_up, down, experts_min, experts_max, activation)


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
    """The bf16 op: the same reading (PB's own test_hpu_mixture_of_experts.py builds w12 with
    `torch.cat((w1, w2), dim=cat_dim)` and the same Mixtral reference); eager is allowed."""
    x, ids, weights = hidden_states, expert_routing_table, router_weights
    _check_common(x, ids, weights, len(w12), len(w3), experts_min, experts_max, activation)
    # PB's test runs permuted_weights False too; we only ever pass True and model only that.
    _contract(permuted_weights, "permuted_weights=True")
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

    def run(*args):
        # ops inside run as part of a compiled graph: the mxfp4 op's eager block does not apply
        _GRAPH[0] += 1
        try:
            return gm.forward(*args)
        finally:
            _GRAPH[0] -= 1

    return run


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
