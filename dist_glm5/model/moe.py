"""Dense MLP, routed experts and the MoE block (routed experts + shared expert).

Routed experts are held fused in the serving layout: w13 [E_local, 2I, H] with each expert's rows
[gate; up] concatenated (not interleaved), and w2 [E_local, H, I]. Under expert parallelism a rank
holds experts first_expert .. first_expert+E_local-1 and contributes only their outputs (the
caller sums over ranks). The experts run through the backend's ops (dist_glm5/ops/experts.py,
where `experts_reference`, the plain loop every fast kernel is checked against, lives), given at
construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.linear import Linear
from dist_glm5.model.router import Router
from dist_glm5.ops import Ops


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, ops: Ops | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, False, ops)
        self.up_proj = Linear(hidden, inter, False, ops)
        self.down_proj = Linear(inter, hidden, False, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Float routed experts in the fused serving layout, run by the backend's dense experts op."""

    def __init__(self, cfg: ModelConfig, ops: Ops, first_expert: int = 0, num_local: int = 0):
        super().__init__()
        self.ops = ops.experts
        self.first_expert, self.num_local = first_expert, num_local or cfg.n_routed_experts
        I, H = cfg.moe_intermediate_size, cfg.hidden_size
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * I, H), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, H, I), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x [T, H], weights [T, k], ids [T, k] int32 global -> [T, H] (this rank's experts)
        lo = self.first_expert
        return self.ops.dense(
            x, ids, weights, self.w13_weight, self.w2_weight, lo, lo + self.num_local - 1
        )


class MXFP4Experts(nn.Module):
    """Routed experts in the packed MXFP4 serving layout (uint8 elements + E8M0 scales, blocks of 32
    along the input dim), run as they are by the backend's MXFP4 experts op (the CPU kernel
    unpacks in registers; the reference decodes each touched expert)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, first_expert: int = 0, num_local: int = 0):
        super().__init__()
        self.ops = ops.experts
        self.first_expert, self.num_local = first_expert, num_local or cfg.n_routed_experts
        I, H, E = cfg.moe_intermediate_size, cfg.hidden_size, self.num_local
        for name, shape in (
            ("w13_weight", (E, 2 * I, H // 2)),
            ("w13_weight_scale", (E, 2 * I, H // 32)),
            ("w2_weight", (E, H, I // 2)),
            ("w2_weight_scale", (E, H, I // 32)),
        ):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.uint8))

    def _apply(self, fn, recurse=True):
        # .to(dtype) must leave the packed bytes uint8
        return super()._apply(lambda t: t if t.dtype == torch.uint8 else fn(t), recurse)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        lo = self.first_expert
        return self.ops.mxfp4(
            x,
            ids,
            weights,
            self.w13_weight,
            self.w13_weight_scale,
            self.w2_weight,
            self.w2_weight_scale,
            lo,
            lo + self.num_local - 1,
        )


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, experts: range | None = None):
        super().__init__()
        self.gate = Router(cfg, ops.route)
        experts = range(cfg.n_routed_experts) if experts is None else experts
        cls = MXFP4Experts if cfg.experts_format == "mxfp4" else Experts
        self.experts = cls(cfg, ops, experts.start, len(experts))
        self.recorder = None  # (RouteRecorder, layer) while routes are being recorded
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, ops)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = self.gate(x)
        if self.recorder is not None:
            self.recorder[0].record(self.recorder[1], ids)
        y = self.experts(x, w, ids.to(torch.int32))  # the ops take int32 ids, as Gaudi's
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
