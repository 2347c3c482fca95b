"""Tensor and expert parallelism inside a stage, applied from outside the model (as gpt-fast does).

A stage's R ranks split attention heads (q_b_proj and kv_b_proj rows, o_proj columns), the dense
MLP and the shared expert (gate/up rows, down columns). Routed experts are either split by expert
(EP = R: the rank loaded only its experts) or, with EP = 1, split along the intermediate dim like
the dense MLP. Router, DSA indexer, norms, embedding and lm_head are replicated. After attention and
after the MLP/MoE each rank holds a partial sum; `reduce` (an all-reduce over the stage) adds them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dist_glm5.model.glm5 import Glm5Model
from dist_glm5.model.layer import DecoderLayer
from dist_glm5.model.linear import linear_from
from dist_glm5.model.moe import MLP, MoE, MXFP4Experts


def _part(n: int, rank: int, ranks: int, what: str, fix: str) -> slice:
    if n % ranks:
        raise ValueError(f"{what}={n} does not split over {ranks} ranks: {fix}")
    k = n // ranks
    return slice(rank * k, (rank + 1) * k)


def _split_mlp(mlp: MLP, rank: int, ranks: int) -> None:
    s = _part(
        mlp.gate_proj.out_features,
        rank,
        ranks,
        "intermediate size",
        "use a TP degree that divides it",
    )
    mlp.gate_proj = linear_from(mlp.gate_proj.weight[s], mlp.gate_proj)
    mlp.up_proj = linear_from(mlp.up_proj.weight[s], mlp.up_proj)
    mlp.down_proj = linear_from(mlp.down_proj.weight[:, s], mlp.down_proj)


def _split_experts_tp(mod, rank: int, ranks: int) -> None:
    """EP = 1 with TP = R: every rank keeps every expert, a slice of its intermediate dim."""
    I = mod.w13_weight.shape[1] // 2
    s = _part(
        I,
        rank,
        ranks,
        "moe_intermediate_size",
        "use a TP degree that divides it, or --ep equal to --tp",
    )
    rows = torch.cat([torch.arange(I)[s], I + torch.arange(I)[s]])  # [gate_r; up_r]
    if isinstance(mod, MXFP4Experts):
        k = s.stop - s.start
        if k % 32:
            raise ValueError(
                f"moe_intermediate_size/{ranks}={k} is not a multiple of 32: MXFP4 blocks run "
                "along the intermediate dim of w2; use --ep equal to --tp instead"
            )
        mod.w13_weight = mod.w13_weight[:, rows].contiguous()
        mod.w13_weight_scale = mod.w13_weight_scale[:, rows].contiguous()
        mod.w2_weight = mod.w2_weight[..., s.start // 2 : s.stop // 2].contiguous()
        mod.w2_weight_scale = mod.w2_weight_scale[..., s.start // 32 : s.stop // 32].contiguous()
    else:
        mod.w13_weight = nn.Parameter(mod.w13_weight[:, rows].contiguous(), requires_grad=False)
        mod.w2_weight = nn.Parameter(mod.w2_weight[..., s].contiguous(), requires_grad=False)


def shard_tensor_parallel(
    model: Glm5Model,
    rank: int,
    ranks: int,
    ep: int,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    exchange_masks: Callable | None = None,
) -> Glm5Model:
    """Split `model` for `rank` of `ranks`. exchange_masks(local, n, L) all-gathers DSA keep-masks:
    with it the sparse indexer scores only this rank's share of the query rows."""
    if ranks == 1:
        return model
    if ep not in (1, ranks):
        raise ValueError(
            f"ep={ep} with {ranks} ranks per stage: EP runs over the stage's ranks, use --ep 1 or "
            f"--ep {ranks}"
        )
    for layer in model.model.layers.values():
        assert isinstance(layer, DecoderLayer)
        a = layer.self_attn
        if a.o_proj.bias is not None or a.q_a_proj.bias is not None:
            raise ValueError("attention_bias=true is not supported with tensor parallelism")
        h = a.n_heads
        s = _part(h, rank, ranks, "num_attention_heads", "use a TP degree that divides it")
        qd, c = a.nope + a.rope, a.kv_lora
        a.q_b_proj = linear_from(
            a.q_b_proj.weight.view(h, qd, -1)[s].reshape(-1, a.q_b_proj.in_features), a.q_b_proj
        )
        a.kv_b_proj = linear_from(
            a.kv_b_proj.weight.view(h, a.nope + a.v_dim, c)[s].reshape(-1, c), a.kv_b_proj
        )
        H = a.o_proj.out_features
        a.o_proj = linear_from(a.o_proj.weight.view(H, h, a.v_dim)[:, s].reshape(H, -1), a.o_proj)
        layer.attn_reduce = reduce
        if exchange_masks is not None and a.indexer is not None:
            a.row_split = (rank, ranks, exchange_masks)
        if isinstance(layer.mlp, MoE):
            if layer.mlp.shared_experts is not None:
                _split_mlp(layer.mlp.shared_experts, rank, ranks)
            if ep == 1:
                _split_experts_tp(layer.mlp.experts, rank, ranks)
        else:
            _split_mlp(layer.mlp, rank, ranks)
        layer.mlp_reduce = reduce
    return model
