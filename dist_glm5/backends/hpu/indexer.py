"""DSA indexer scores and top-k selection for Gaudi: static shapes, int32-only integer math.

Lazy mode casts int64 tensors to int32 on the device (PT_ENABLE_INT64_SUPPORT is false there), so
the reference bisection (ops/topk.py `kth_threshold_keys`, whose open upper bound is 2^31 held in
int64, plus a data-dependent early exit and compaction) would wrap. Here the interval is kept
CLOSED, [lo, hi] with both ends int32: invariant count(keys >= lo) >= k and count(keys > hi) < k.
Each pass tests mid = ceil((lo + hi) / 2) (computed without overflow); 32 fixed passes close any
int32 interval, with no `.item()`, no early exit and no shape that depends on the data. The
selection then keeps the keys above the threshold and, among the keys equal to it, the earliest:
the reference's tie rule, so the keep-masks are identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dist_glm5.ops.topk import ordered_keys

INT32_MIN = -(2**31)
PASSES = 32  # an int32 interval of 2^32 values closes in 32 halvings


def index_scores(q: Tensor, w: Tensor, keys: Tensor, head_dim: int) -> Tensor:
    """Same contract and arithmetic as model/indexer.index_scores (fp32, scale on the head weights):
    q [..., n, Hi, D], w [..., n, Hi] fp32, keys [..., L, D] -> [..., n, L] fp32."""
    s = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(-3)))
    return torch.matmul((w * head_dim**-0.5).unsqueeze(-2), s).squeeze(-2)


def _ceil_mid(lo: Tensor, hi: Tensor) -> Tensor:
    # ceil((lo + hi) / 2) in int32 without forming lo + hi (arithmetic shifts floor)
    return (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)


def kth_largest_key(keys: Tensor, k: int) -> Tensor:
    """keys [R, L] int32 -> [R] int32: each row's k-th largest key (1 <= k <= L)."""
    R = keys.shape[0]
    lo = torch.full((R,), INT32_MIN, dtype=torch.int32, device=keys.device)
    hi = torch.full((R,), 2**31 - 1, dtype=torch.int32, device=keys.device)
    for _ in range(PASSES):
        mid = _ceil_mid(lo, hi)
        ok = (keys >= mid[:, None]).sum(-1, dtype=torch.int32) >= k
        lo = torch.where(ok, mid, lo)
        # mid > lo whenever lo < hi, so mid - 1 >= lo never wraps where it is taken
        hi = torch.where(ok, hi, mid - 1)
    return lo


def select_topk(scores: Tensor, q_pos: Tensor, topk: int) -> Tensor:
    """Keep-mask [..., L]: each query's top-min(topk, valid) causal keys, ties to the earlier key.
    Same contract and result as indexer.select_topk_reference; scores [..., L], q_pos [...]."""
    L = scores.shape[-1]
    causal = torch.arange(L, device=scores.device) <= q_pos[..., None]
    if topk >= L:
        return causal
    # ordered_keys gives -0.0 and +0.0 one key (the reference's sort ties them): the CPU rule
    keys = ordered_keys(scores.float().masked_fill(~causal, float("-inf")))
    shape = keys.shape
    flat = keys.reshape(-1, L)
    t = kth_largest_key(flat, topk)[:, None]
    above = flat > t
    need = topk - above.sum(-1, keepdim=True, dtype=torch.int32)
    tie = flat == t
    keep = above | (tie & (tie.cumsum(-1, dtype=torch.int32) <= need))
    return keep.reshape(shape) & causal
