"""Rotary position embedding: host tables computed once in fp32 and sliced by position.

The table is the host "rope cache" long context needs: cos/sin for every position up to the
largest seen (grown by doubling, up to `MAX_POSITIONS`), so a step only slices rows. Applying
them is the backend's (`Ops.apply_rope`; the reference, both pair layouts, in ops/rope.py).
"""

from __future__ import annotations

import math

import torch

from dist_glm5.model.config import RopeConfig

MAX_POSITIONS = 1 << 20  # 1,048,576: covers the 637K two-node context with room to spare


def inv_freq_and_scale(
    rope: RopeConfig, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin post-scale for the rope type."""
    base = rope.theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.type == "default":
        return inv, 1.0
    if rope.type == "linear":
        return inv / rope.factor, 1.0
    # yarn (the same arithmetic as transformers' _compute_yarn_parameters)
    omp = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / omp

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rope.attention_factor
    if att is None:
        att = (
            mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
            if rope.mscale and rope.mscale_all_dim
            else mscale(factor)
        )
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(omp / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, float(att)


def table_bytes(context: int, dim: int, initial: int = 4096) -> int:
    """What a stage's RopeTable holds: cos and sin, [rows, dim/2] fp32 each, reserved for the
    stage's whole context when it starts (CpuStage / HpuStage), so it never grows mid-run (the
    planner's term)."""
    return 2 * max(context, initial) * (dim // 2) * 4


class RopeTable:
    """cos/sin [positions, dim/2] in fp32 on the host, grown on demand and sliced per step."""

    def __init__(
        self, rope: RopeConfig, dim: int, max_position_embeddings: int, initial: int = 4096
    ):
        self.inv_freq, self.scale = inv_freq_and_scale(rope, dim, max_position_embeddings)
        self.cos = torch.empty(0, dim // 2)
        self.sin = torch.empty(0, dim // 2)
        self._grow(initial)

    def reserve(self, n: int) -> None:
        """Exactly n rows now (if fewer): a stage reserves its whole context when it starts, so
        the table is never regrown (by doubling, with old and new tables live at once) mid-run:
        at 637K the growth to 1M rows held 87 MiB more from the last fifth of the prompt on."""
        if n > self.cos.shape[0]:
            self._grow(n, exact=True)

    def _grow(self, n: int, exact: bool = False) -> None:
        if n > MAX_POSITIONS:
            raise ValueError(f"position {n - 1} is beyond the RoPE table limit {MAX_POSITIONS - 1}")
        size = n if exact else max(n, min(2 * self.cos.shape[0], MAX_POSITIONS))
        self.cos = self.sin = torch.empty(0)  # the old tables go before the new ones are made
        freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.cos = freqs.cos().mul_(self.scale)
        self.sin = freqs.sin_().mul_(self.scale)  # in place: one [size, dim/2] buffer fewer

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, dim/2] fp32
        hi = int(positions.max()) + 1 if positions.numel() else 0
        if hi > self.cos.shape[0]:
            self._grow(hi)
        return self.cos[positions], self.sin[positions]
