"""Int8 indexer keys (opt-in `DSAConfig.index_keys="int8"`): the codec and its cache-row layout.

DeepSeek's own inference code and vLLM's indexer keep the DSA indexer's keys in FP8 with one
fp32 scale per key (132 B a token at index_head_dim 128, against 256 in bf16) and score
quantised queries against them. This is the same idea in int8, which CPUs multiply natively
(AVX-512 VNNI `vpdpbusd`: 64 products an instruction): symmetric, one fp32 scale per vector,

    scale = amax(|x|) / 127  (1 for an all-zero vector)
    x8 = clamp(round_half_even(x / scale), -127, 127)

A cache row is D + 4 bytes: the D int8 values, then the scale's fp32 bytes (little-endian), so a
key and its scale are one row of one uint8 tensor and every gather of slots stays as it is.
Queries are quantised the same way per (row, head) when they are scored; the score is then

    score[t, s] = ks[s] * sum_h (w[t, h] * D**-0.5 * qs[t, h]) * relu(idot[t, h, s])

with idot the exact integer dot product of q8 and k8 (the scales are positive, so they leave the
relu: one multiply per head and key). A selection from these scores differs
from the exact one only where scores come within the quantisation error of each other.
"""

from __future__ import annotations

import torch

QMAX = 127
SCALE_BYTES = 4
# an index-key store's code in the C kernels (dsa_select.c, mla_project.c): fp32, bf16, these rows
KERNEL_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}


def row_bytes(head_dim: int) -> int:
    """Bytes of one key's cache row."""
    return head_dim + SCALE_BYTES


def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (x8 [..., D] int8, scale [...] fp32)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    x8 = torch.round(xf / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return x8, scale


def pack(x: torch.Tensor) -> torch.Tensor:
    """Keys x [m, D] -> cache rows [m, D + 4] uint8 (int8 values, then the fp32 scale)."""
    x8, scale = quantise(x)
    return torch.cat([x8.view(torch.uint8), scale[:, None].view(torch.uint8)], dim=1)


def unpack(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows [m, D + 4] uint8 -> (k8 [m, D] int8, scale [m] fp32)."""
    D = rows.shape[-1] - SCALE_BYTES
    k8 = rows[:, :D].view(torch.int8)
    scale = rows[:, D:].contiguous().view(torch.float32)[:, 0]
    return k8, scale


def empty_store(slots: int, head_dim: int, device=None) -> torch.Tensor:
    """A cache of `slots` key rows in this layout."""
    return torch.empty(slots, row_bytes(head_dim), dtype=torch.uint8, device=device)


def is_store(store: torch.Tensor) -> bool:
    """Whether an index-key store (or a gather of its rows) is in this layout."""
    return store.dtype == torch.uint8


def write(store: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """store[slots] = keys [T, D] in the store's layout (int8 rows, or the store's dtype)."""
    store[slots] = pack(keys) if is_store(store) else keys.to(store.dtype)
