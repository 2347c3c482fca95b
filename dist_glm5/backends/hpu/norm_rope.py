"""RMSNorm and RoPE for Gaudi, with the CPU references' signatures (ops/norm.py, ops/rope.py).

rms_norm: FusedRMSNorm (habana_frameworks.torch.hpex.normalization) normalises in fp32 with a unit
weight; the cast to x's dtype and the multiply by `weight` follow, in the reference's order
(statistics in fp32, scale applied after casting back, as transformers does). Whether the fused
kernel's own weight multiply rounds the same way is open (gaudi.md section 10 item 6); until
measured we keep the reference order.

RoPE: the table is computed once on the host (model/rope.RopeTable: fp32 cos/sin per position),
copied to the device once up to the serving context, and sliced per step with an int32
index_select: no growth, no `.max()` of the positions inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dist_glm5.ops.rope import apply_rope as reference_apply_rope

from . import _hf

_UNIT: dict[tuple[int, torch.device], Tensor] = {}


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    key = (x.shape[-1], x.device)
    if key not in _UNIT:
        _UNIT[key] = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    h = _hf.fused_rms_norm().apply(x.float(), _UNIT[key], eps)
    return weight * h.to(x.dtype)


# RoPE itself is plain elementwise torch that lowers to TPC as it is: the reference serves
# (ops/rope.apply_rope); what Gaudi needs differently is the table (DeviceRopeTable below).
apply_rope = reference_apply_rope


@dataclass(frozen=True)
class DeviceRopeTable:
    """cos/sin [positions, dim/2] fp32 on the device, sized once for the serving context."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def from_host(cls, table, positions: int, device: str | torch.device) -> "DeviceRopeTable":
        """table: a model/rope.RopeTable; positions: the largest context served."""
        table.reserve(positions)  # the host table at exactly its size, once, here
        return cls(table.cos[:positions].to(device), table.sin[:positions].to(device))

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # positions [T] (padded rows carry any valid position) -> cos, sin [T, dim/2]
        idx = positions.to(self.cos.device, torch.int32)
        return self.cos.index_select(0, idx), self.sin.index_select(0, idx)
