"""nn.Linear whose product is the backend's (`Ops.linear`): the CPU backend multiplies bf16 in
fp32 on CPUs without bf16 GEMM instructions (ops/linear.py). Same parameters and state-dict names
as nn.Linear, so checkpoints and tensor-parallel splits see no difference."""

from __future__ import annotations

import torch
from torch import nn

from dist_glm5.ops import Ops
from dist_glm5.ops.linear import linear


class Linear(nn.Linear):
    def __init__(self, fan_in: int, fan_out: int, bias: bool = True, ops: Ops | None = None, **kw):
        super().__init__(fan_in, fan_out, bias=bias, **kw)
        self.product = ops.linear if ops is not None else linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


def linear_from(w: torch.Tensor, like: Linear | None = None) -> Linear:
    """A bias-free Linear holding `w` [out, in] (a tensor-parallel slice), with `like`'s product."""
    lin = Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    if like is not None:
        lin.product = like.product
    return lin
