"""Rotary position embedding applied to a tensor: the reference of `Ops.apply_rope`.

GLM rotates interleaved pairs (x0,x1),(x2,x3),...; DeepSeek-V3.2 rotates the two halves. Either
way the output is written half-split ([rotated evens | rotated odds]), as the reference does; q
and k get the same permutation, so q.k is unchanged. The cos/sin tables are model/rope.py's.
"""

from __future__ import annotations

import torch


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    # x: [T, ..., dim]; cos/sin: [T, dim/2] broadcast over the middle (head) dims.
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos = cos.to(x.dtype).view(shape)
    sin = sin.to(x.dtype).view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
