"""Sigmoid grouped top-k router (DeepSeek-V3 / GLM-5).

Scores s = sigmoid(x @ W.T) in fp32. Selection uses s + e_score_correction_bias; groups are ranked
by the sum of their two best biased scores, the best `topk_group` groups kept, then the top
`num_experts_per_tok` experts among them. Weights are the UNbiased s of the chosen experts,
normalised to sum 1 (norm_topk_prob), times routed_scaling_factor. Expert ids are int32, the
dtype serving MoE kernels take.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dist_glm5.model.config import ModelConfig


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, H], weight: [E, H] fp32, bias: [E] fp32 -> weights [T, k] fp32, ids [T, k] int32
    T, E = x.shape[0], weight.shape[0]
    s = torch.sigmoid(torch.nn.functional.linear(x.float(), weight.float()))  # [T, E]
    choice = s + bias
    if n_group > 1:
        group_scores = (
            choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        )  # [T, G]
        keep_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        gmask = torch.zeros(T, n_group, dtype=torch.bool, device=s.device)
        gmask.scatter_(1, keep_groups, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices  # [T, k]
    w = s.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids.to(torch.int32)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, route_op: Callable | None = None):
        """route_op: the backend's router (Ops.route), `route` below its fallback; None: route."""
        super().__init__()
        self.cfg = cfg
        self.route_op = route_op
        self.weight = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32),
            requires_grad=False,
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        args = (
            x,
            self.weight,
            self.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        if self.route_op is None:
            return route(*args)
        return self.route_op(*args, fallback=route)
