"""Hot ops behind one interface each, the reference beside the fast path; the backend picks.

`Ops` is what the model is built with (`Glm5Model(..., ops=)`): chosen once, at construction, by
the backend (`dist_glm5.backends`), never switched by walking modules or by mode strings. Each
field has the signature of its CPU reference (named in `reference_ops`); a backend replaces the
fields it has a faster or device-native version of (`dataclasses.replace(reference_ops(), ...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor

    from dist_glm5.ops.experts import ExpertsOps

    Fn = Callable[..., Tensor]


@dataclass(frozen=True)
class Ops:
    name: str
    experts: "ExpertsOps"  # routed experts, MXFP4 and dense (ops/experts.py)
    # (scores [..., L] fp32, q_pos [...], topk) -> keep mask [..., L]: each query's top-k causal
    # keys, ties to the earlier key (ops/topk.py)
    select_topk: "Fn"
    # (q [..., n, Hi, D], w [..., n, Hi], keys [..., L, D], head_dim) -> scores [..., n, L] fp32
    # (ops/indexer.py)
    index_scores: "Fn"
    # dense MLA over a group's keys with a keep mask, expanded (prefill) and absorbed (decode):
    # (q_nope, q_rot, latent, k_rot, w_kv_b, keep, scale, nope) -> [B, n, h, v] (ops/attention.py)
    mla_expanded: "Fn"
    mla_absorbed: "Fn"
    # sparse prefill by windows over capped key chunks with an online softmax
    # (ops/attention.py): -> latent output [n, h, c] fp32
    attend_absorbed_chunked: "Fn"
    # sparse attention of rows over each one's own selected keys (decode, and prefill by rows):
    # (q_nope [n, h, nope], q_rot [n, h, r], w_kv_b, kv_store, slots, valid [n, k], nope, scale,
    # cap) -> [n, h, v] in q_nope's dtype: W_uk, attend_gathered, W_uv
    # (ops/attention.absorbed_gathered)
    absorbed_gathered: "Fn"
    rms_norm: "Fn"  # (x [..., D], weight [D], eps) -> [..., D] (ops/norm.py)
    # dense projections (model/linear.Linear) and the MLA head products with kv_b_proj's
    # weight, in the activation dtype: (x [..., K], w [N, K], bias) -> [..., N] and
    # (eq, a, b) -> einsum (ops/linear.py)
    linear: "Fn"
    einsum: "Fn"
    apply_rope: "Fn"  # (x [T, ..., dim], cos, sin [T, dim/2], interleave) (ops/rope.py)
    # Optional fused selection for rows of one sequence: (q, w, idx_store, keys, q_pos, topk,
    # head_dim, keep=None) -> (keep [n, L], slots [n, k], valid [n, k]), what index_scores +
    # select_topk + dsa.selected_slots give (kernels/dsa_select.py). None: those three.
    select_rows: "Callable | None" = None
    # Optional: select_rows for the rows of several sequences at once (a decode batch):
    # (q [R, Hi, D], w [R, Hi], idx_store, rows: RowsKeys, topk, head_dim) -> (slots, valid
    # [R, topk]), each sequence's picks padded to topk (kernels/dsa_select.select_many). None:
    # one select_rows (or the torch path) per sequence.
    select_many: "Callable | None" = None
    # Optional: a decode step's MLA and indexer projections and cache writes in one call per
    # layer (ops/mla_project.py has the contract; kernels/mla_project.project). None, or a call it
    # declines: the model composes linear, rms_norm, apply_rope and the writes itself.
    mla_project: "Callable | None" = None
    # Optional: the MoE router of a few tokens in one call: (x, weight, bias, top_k, n_group,
    # topk_group, norm_topk_prob, scaling, fallback) -> (weights [T, k] fp32, ids [T, k] int32),
    # model/router.route's contract (that function is the fallback, passed by the caller, and the
    # reference: kernels/router.py). None: the reference.
    route: "Callable | None" = None
    # Optional: a whole decode step of a model's layers, planned once: (model) -> a callable
    # (x, batch, cache, keep) -> what the model's forward returns, or None for a step it does not
    # take (backends/cpu_plan.py); the factory returns None for a model it cannot run. The
    # layers' modules are its reference and run every step it declines. None: the modules.
    decode_plan: "Callable | None" = None


def reference_ops() -> Ops:
    """The plain references: what every fast op is tested against."""
    # imported here, not above: `Ops` itself needs no torch (the control plane reads configs)
    from dist_glm5.ops import attention
    from dist_glm5.ops.experts import REFERENCE
    from dist_glm5.ops.indexer import index_scores
    from dist_glm5.ops.linear import einsum, linear
    from dist_glm5.ops.norm import rms_norm
    from dist_glm5.ops.rope import apply_rope
    from dist_glm5.ops.topk import select_topk_bisect

    return Ops(
        name="reference",
        experts=REFERENCE,
        select_topk=select_topk_bisect,
        index_scores=index_scores,
        mla_expanded=attention.mla_expanded,
        mla_absorbed=attention.mla_absorbed,
        attend_absorbed_chunked=attention.attend_absorbed_chunked,
        absorbed_gathered=attention.absorbed_gathered,
        rms_norm=rms_norm,
        linear=linear,
        einsum=einsum,
        apply_rope=apply_rope,
    )
