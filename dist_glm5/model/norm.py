"""RMSNorm and LayerNorm modules holding their weights; the math is ops/norm.py's (fp32
statistics, like the reference), RMSNorm's the backend's (`Ops.rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from dist_glm5.ops import Ops
from dist_glm5.ops.norm import layer_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.rms_norm = ops.rms_norm if ops else rms_norm  # the backend's, or the reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
