"""RMSNorm and LayerNorm as plain functions (fp32 statistics, like the reference).

`rms_norm` is the reference of `Ops.rms_norm`; the modules holding the weights are in
model/norm.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D], weight: [D]. Statistics in fp32, scale applied after casting back (as
    # transformers does).
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    # x: [..., D]. The DSA indexer's key norm is a LayerNorm with bias.
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
