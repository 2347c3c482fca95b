"""Top-k selection at long context: the k-th largest score by bisection, not by sorting.

Scores are fp32; each is mapped to an int32 key that orders like the float (flip the magnitude bits
of negatives) and, like the float's `==`, gives -0.0 and +0.0 one key, so bisection over the 2^32
keys finds each row's exact k-th largest value in 32 passes of compare-and-count, O(32 * L) per row
with no sort and no [L] index buffers.
Selection then keeps every score above the threshold and, among scores equal to it, the earliest
keys: the tie rule of `indexer.select_topk_reference` (stable descending sort, which compares floats
and so ties -0.0 with +0.0), so both select exactly the same keys, signed zeros included. Rows with
fewer than k finite scores keep all of their finite scores.

Ranks exchange selections as bit-packed masks (1 bit per key).
"""

from __future__ import annotations

import torch

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def count_true(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., L] -> int32 [...] Trues per row. Summing the bytes as uint8 into int32 is 10x
    count_nonzero on CPU (which widens every element to int64 first)."""
    return mask.view(torch.uint8).sum(-1, dtype=torch.int32)


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 keys with key(a) < key(b) iff a < b and key(a) == key(b) iff a == b, for
    non-NaN a, b: -0.0 and +0.0 share key 0, as they compare equal in the reference's sort.

    Negatives get their magnitude bits flipped (so -0.0 would land on -1) and then 1 added, which
    moves -0.0 onto +0.0 and keeps every other key distinct and in order. Integer ops only, int32
    throughout (keys span INT32_MIN + 1 .. INT32_MAX): a graph compiler may not fold them away
    as it might `x + 0.0`, and lazy mode's int64-to-int32 cast never touches them."""
    b = x.contiguous().view(torch.int32)
    neg = b >> 31  # -1 for a set sign bit, else 0
    return (b ^ (neg & 0x7FFFFFFF)) - neg


def key_to_float(k: torch.Tensor) -> torch.Tensor:
    """The inverse of ordered_keys (key 0 gives +0.0)."""
    neg = k >> 31
    return ((k + neg) ^ (neg & 0x7FFFFFFF)).view(torch.float32)


def kth_threshold_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """keys [..., L] int32 -> per row a key t with count(keys >= t) >= k and count(keys > t) < k...
    precisely: either count(keys >= t) == k (the top-k set is exactly {keys >= t}), or t is the k-th
    largest key.

    Bisection over the 2^32 key values; a row stops as soon as its count hits k exactly (typical
    after ~log2(L) passes for distinct scores), the rest go on until the interval closes."""
    shape, L = keys.shape[:-1], keys.shape[-1]
    keys = keys.reshape(-1, L)
    lo = torch.full(keys.shape[:1], _INT32_MIN, dtype=torch.int64)  # count(keys >= lo) >= k always
    hi = (
        torch.full(keys.shape[:1], _INT32_MAX, dtype=torch.int64) + 1
    )  # count(keys >= hi) < k always
    n_lo = torch.full(keys.shape[:1], L, dtype=torch.int64)  # count(keys >= lo)
    n_hi = torch.zeros(keys.shape[:1], dtype=torch.int64)  # count(keys >= hi)
    done = torch.zeros(keys.shape[:1], dtype=torch.bool)
    base = torch.zeros_like(n_hi)  # keys counted above the working set (after compaction)
    work = keys
    for _ in range(33):  # the width halves each pass
        mid = (lo + hi) // 2
        cnt = (work >= mid[:, None].to(torch.int32)).sum(-1) + base
        ok = cnt >= k
        upd = ~done
        lo, n_lo = torch.where(ok & upd, mid, lo), torch.where(ok & upd, cnt, n_lo)
        hi, n_hi = torch.where(~ok & upd, mid, hi), torch.where(~ok & upd, cnt, n_hi)
        done |= (cnt == k) | (hi - lo <= 1)
        if bool(done.all()):
            break
        # Once few keys remain between lo and hi, keep only those (padded) and count over them:
        # every later pass reads a small [rows, C] block instead of the whole row.
        in_range = (n_lo - n_hi)[~done]
        if work is keys and int(in_range.max()) * 16 <= L:
            # hi may still be 2^31 (no upper bound found yet): compare in int64
            sel = (
                (keys >= lo[:, None].to(torch.int32)) & (keys.long() < hi[:, None]) & ~done[:, None]
            )
            C = max(1, int(sel.sum(-1).max()))
            pos = torch.where(sel, sel.cumsum(-1) - 1, C)  # slot C collects what is dropped
            work = torch.full((keys.shape[0], C + 1), _INT32_MIN, dtype=torch.int32)
            work.scatter_(1, pos, torch.where(sel, keys, _INT32_MIN))
            work = work[:, :C]
            base = n_hi
    return lo.to(torch.int32).reshape(shape)


def kth_largest_bisect(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., L] fp32 -> the k-th largest value of each row [...]
    (== torch.topk(.., k).values[..., -1]).

    Exact for any values including ties, -inf and +inf; k must be <= L."""
    L = scores.shape[-1]
    if not 1 <= k <= L:
        raise ValueError(f"k={k} must be in 1..{L}")
    keys = ordered_keys(scores.float())
    t = kth_threshold_keys(keys, k)
    # the k-th largest is the smallest key >= t (t itself when the interval closed on it)
    big = torch.full_like(keys, _INT32_MAX)
    return key_to_float(torch.where(keys >= t[..., None], keys, big).amin(-1))


def select_topk_bisect(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Boolean keep-mask [..., L]: each query's top-min(topk, valid) causal keys, ties to earlier
    keys.

    Same contract and result as indexer.select_topk_reference; scores [..., L], q_pos [...]."""
    L = scores.shape[-1]
    causal = torch.arange(L) <= q_pos[..., None]
    if topk >= L:
        return causal
    s = scores.float().masked_fill(~causal, float("-inf"))
    k = min(topk, L)
    keys = ordered_keys(s)
    t = kth_threshold_keys(keys, k)[..., None]
    above = keys > t
    need = k - above.sum(
        -1, keepdim=True
    )  # how many keys equal to t to keep (0 when {>= t} had exactly k)
    tie = keys == t
    keep = above | (tie & (tie.cumsum(-1) <= need))
    return keep & causal


def select_topk_sorted(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Same contract and keys as select_topk_bisect, with the k-th value from torch.topk: the
    fastest exact method on CPU (6x bisection per row at 64K keys here), where Gaudi prefers
    bisection (no sort). Ties to the earlier key, as the reference's stable sort."""
    L = scores.shape[-1]
    causal = torch.arange(L) <= q_pos[..., None]
    if topk >= L:
        return causal
    s = scores.float().masked_fill(~causal, float("-inf"))
    # the k-th and (k+1)-th largest: more than k keys are >= the k-th exactly when they are equal
    top = torch.topk(s, topk + 1, dim=-1, sorted=True).values
    t = top[..., topk - 1 : topk]
    keep = s >= t
    # Rows with a tie across the k-th place (or fewer than k causal keys, all -inf there): among
    # the keys equal to t keep the earliest. Usually no row: the cumulative count runs on those.
    flat = keep.view(-1, L)
    over = (top[..., topk] == top[..., topk - 1]).reshape(-1).nonzero().squeeze(-1)
    if over.numel():
        so, to = s.reshape(-1, L)[over], t.reshape(-1, 1)[over]
        above, tie = so > to, so == to
        need = topk - above.sum(-1, keepdim=True)
        flat[over] = above | (tie & (tie.cumsum(-1) <= need))
    return keep & causal


def pack_mask(m: torch.Tensor) -> torch.Tensor:
    """bool [..., L] -> uint8 [..., ceil(L/8)], bit j of byte i is key 8i+j."""
    L = m.shape[-1]
    pad = (-L) % 8
    if pad:
        m = torch.nn.functional.pad(m, (0, pad))
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (m.view(*m.shape[:-1], -1, 8).to(torch.uint8) * w).sum(-1, dtype=torch.uint8)


def unpack_mask(p: torch.Tensor, L: int) -> torch.Tensor:
    bits = (p[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(*p.shape[:-1], -1)[..., :L].bool()
