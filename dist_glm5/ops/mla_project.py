"""The optional fused op `Ops.mla_project`: a decode step's MLA and DSA-indexer projections (and
their cache writes) in one call per layer. Its reference is the module's own composition of the
other ops (model/mla.py `MLA._project`, model/indexer.py), which runs whenever the op is None or
declines a call (returns None).

    mla_project(x [T, H], w: ProjectWeights, cos, sin [T, rope/2] fp32, slots [T] int64,
                kv_store [S, kv_lora + rope], idx_store [S, i_dim] or None)
        -> (q [T, h, nope + rope] unroped, q_rot [T, h, rope] roped,
            iq [T, hi, i_dim] or None, iw [T, hi] fp32 or None), the cache rows written;
           or None: not taken (the caller composes the ops itself).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class IndexerWeights(NamedTuple):
    heads: int
    head_dim: int
    interleave: bool
    wq_b: Tensor  # [heads * head_dim, q_lora]
    wk: Tensor  # [head_dim, H]
    k_norm_weight: Tensor  # [head_dim] (a LayerNorm with bias)
    k_norm_bias: Tensor
    k_norm_eps: float
    weights_proj: Tensor  # [heads, H]


class ProjectWeights(NamedTuple):
    """One layer's projection weights and sizes, as model/mla.py and model/indexer.py hold them."""

    heads: int  # local heads (fewer under TP)
    nope: int
    rope: int
    kv_lora: int
    interleave: bool
    q_a: Tensor  # [q_lora, H]
    q_a_bias: Tensor | None
    q_a_norm: Tensor  # [q_lora]
    q_a_eps: float
    q_b: Tensor  # [h * (nope + rope), q_lora]
    kv_a: Tensor  # [kv_lora + rope, H]
    kv_a_bias: Tensor | None
    kv_a_norm: Tensor  # [kv_lora]
    kv_a_eps: float
    # the indexer's (None on a layer without one)
    indexer: IndexerWeights | None
