"""Sparse DSA at scale: what the reference masks densely (O(T^2)), computed over gathered keys.

- Indexer scores are computed against the cached indexer keys in capped chunks; each query row's
  selection comes from the backend's exact top-k (ops/topk.py: torch.topk on CPU, bisection on
  Gaudi; same keys as the reference, ties to earlier keys).
- Decode (small chunks): gather exactly each query's selected rows (<= index_topk) from the paged
  latent cache and attend over them with the absorbed MLA form: cost no longer grows with context
  (the indexer itself still scans every key once).
- Prefill: per window of `window` neighbouring queries, the union of their selected keys is gathered
  once; when that union exceeds `union_max_frac` of the context, the window attends densely over all
  keys with the selection as a mask; contexts of at most `dense_threshold` keys always attend
  densely. Dense or sparse, attention runs over key chunks with an online softmax (fp32 statistics),
  so no gather exceeds `gather_cap_bytes` and no [queries, context] score matrix is materialised at
  once.
- Every gather goes through ops/gather.py's `capped_chunks`: calls of at most `gather_cap_bytes`
  each, keys addressed through the sequence's block table (`KeySlots`).
This file chooses what to gather and attend over; the attention math itself is the backend's
(references in ops/attention.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.ops import Ops
from dist_glm5.ops.gather import (
    attn_key_chunks,
    capped_chunks,
    decode_row_bytes,
    gather_keys,
    key_ranges,
)
from dist_glm5.ops.indexer import index_scores
from dist_glm5.ops.key_slots import KeySlots
from dist_glm5.ops.topk import count_true

GIB = 1 << 30
SCORE_CACHE_BYTES = 4 << 20  # indexer scores kept per key chunk (about a core's L2 + share of L3)


def index_scores_capped(
    q: torch.Tensor,
    w: torch.Tensor,
    idx_store: torch.Tensor,
    keys: KeySlots,
    head_dim: int,
    cap: int,
    scores_fn=index_scores,
) -> torch.Tensor:
    """q [n, Hi, D], w [n, Hi] fp32, keys of L positions -> scores [n, L] fp32, keys gathered in
    capped chunks, each scored by `scores_fn` (the backend's index_scores)."""
    n, L = q.shape[0], len(keys)
    out = torch.empty(n, L, dtype=torch.float32, device=q.device)
    per = index_key_rows(n, q.shape[1], idx_store.shape[1] * idx_store.element_size(), cap)
    # Key chunks whose [n, Hi, chunk] fp32 scores stay in the core's cache: the relu and the
    # head-weighted sum then run from cache, not DRAM (16K keys, 256 rows: 5x faster than one
    # cap-sized chunk).
    per = min(per, max(keys.block_size, SCORE_CACHE_BYTES // max(1, n * q.shape[1] * 4)))
    q = q.float()  # once, not per chunk
    for a, b, by_blocks in key_ranges(L, per, keys.block_size):
        out[:, a:b] = scores_fn(q, w, gather_keys(idx_store, keys, a, b, by_blocks), head_dim)
    return out


def score_rows(cfg: DSAConfig, L: int) -> int:
    """Query rows scored at once: their fp32 scores, int32 order keys and masks stay under the
    cap."""
    return max(1, min(cfg.indexer_row_chunk, cfg.gather_cap_bytes // (L * 9)))


def index_key_chunks(n: int, heads: int, L: int, row_bytes: int, cap: int) -> list[tuple[int, int]]:
    """Key chunks for scoring n query rows: the gather and the [n, heads, chunk] fp32 buffer both
    under the cap."""
    per = index_key_rows(n, heads, row_bytes, cap)
    return [(a, min(L, a + per)) for a in range(0, L, per)]


def index_key_rows(n: int, heads: int, row_bytes: int, cap: int) -> int:
    return max(1, min(cap // row_bytes, cap // max(1, n * heads * 4)))


def select(
    q: torch.Tensor,
    w: torch.Tensor,
    idx_store: torch.Tensor,
    keys: KeySlots,
    q_pos: torch.Tensor,
    topk: int,
    head_dim: int,
    cfg: DSAConfig,
    ops: Ops,
    row_split: tuple[int, int, Callable] | None = None,
) -> torch.Tensor:
    """Keep-mask [n, L] for n query rows over the sequence's L keys (the backend's index scores
    and exact top-k; capped gathers).

    row_split = (rank, ranks, all_gather_packed): each rank scores its share of the rows and the
    ranks exchange bit-packed masks, so every rank ends with all rows' selections."""
    n, L = q.shape[0], len(keys)
    rows = range(n)
    if row_split is not None:
        rank, ranks, exchange = row_split
        per = -(-n // ranks)
        rows = range(min(n, rank * per), min(n, (rank + 1) * per))
    keep = torch.zeros(len(rows), L, dtype=torch.bool, device=q.device)
    step = score_rows(cfg, L)
    for a in range(rows.start, rows.stop, step):
        b = min(rows.stop, a + step)
        s = index_scores_capped(
            q[a:b], w[a:b], idx_store, keys, head_dim, cfg.gather_cap_bytes, ops.index_scores
        )
        keep[a - rows.start : b - rows.start] = ops.select_topk(s, q_pos[a:b], topk)
    if row_split is not None:
        keep = exchange(keep, n, L)
    return keep


def select_fused(
    q: torch.Tensor,
    w: torch.Tensor,
    idx_store: torch.Tensor,
    keys: KeySlots,
    q_pos: torch.Tensor,
    topk: int,
    head_dim: int,
    cfg: DSAConfig,
    ops: Ops,
    mask: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """select() and selected_slots() in one, by the backend's fused `select_rows`: (keep [n, L],
    slots [n, k], valid [n, k]). Rows go in blocks of score_rows(), as select() scores them, so
    the kernel's [rows, L] scores stay under the gather cap; each block fills its rows of keep.
    mask=False: keep is None (the caller attends by the slots; no [n, L] mask to fault in)."""
    n, L = q.shape[0], len(keys)
    step = score_rows(cfg, L)
    if n <= step:
        return ops.select_rows(q, w, idx_store, keys, q_pos, topk, head_dim, None, mask)
    keep = torch.zeros(n, L, dtype=torch.bool, device=q.device) if mask else None
    slots, valid = [], []
    for a in range(0, n, step):
        b = min(n, a + step)
        _, s, v = ops.select_rows(
            q[a:b],
            w[a:b],
            idx_store,
            keys,
            q_pos[a:b],
            topk,
            head_dim,
            keep[a:b] if mask else None,
            mask,
        )
        slots.append(s)
        valid.append(v)
    return keep, torch.cat(slots), torch.cat(valid)


def selected_slots(
    keep: torch.Tensor, keys: KeySlots, k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [n, L] (<= k True per row, >= 1) -> (slots [n, k], valid [n, k]): each row's kept
    positions in key order; padding repeats the row's first pick. Static shapes, no sort over the
    context: a top-k of the mask bytes finds the kept positions, a sort of k ids orders them.
    k: the padded width (default: the most any row keeps, read from the data)."""
    n, L = keep.shape
    k = min(k, L) if k is not None else int(count_true(keep).max())
    v, idx = keep.view(torch.uint8).topk(k, dim=-1)  # kept positions first, in no set order
    order = torch.where(v.bool(), idx, idx + L).sort(-1).values  # kept first, in key order
    valid = order < L
    idx = torch.where(valid, order, order[:, :1])
    return keys.at(idx), valid


def sparse_prefill(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    kv_store: torch.Tensor,
    keys: KeySlots,
    keep: torch.Tensor,
    kv_lora: int,
    scale: float,
    cfg: DSAConfig,
    ops: Ops,
    topk: int | None = None,
) -> torch.Tensor:
    """Prefill rows [n] over L keys (at most `topk` kept per row), the "windows" form: per window
    the union of selections, or dense with the mask (by the backend's attend_absorbed_chunked).
    The "rows" form is the decode call's (model/mla.py: each row over its own selected rows)."""
    n, L = q_lat.shape[0], len(keys)
    attend_absorbed_chunked = ops.attend_absorbed_chunked
    out = torch.empty(n, q_lat.shape[1], q_lat.shape[2], device=q_lat.device)
    for a in range(0, n, cfg.window):
        b = min(n, a + cfg.window)
        win = keep[a:b]
        if L <= cfg.dense_threshold:
            out[a:b] = attend_absorbed_chunked(
                q_lat[a:b], q_rot[a:b], kv_store, keys, win, kv_lora, scale, cfg.gather_cap_bytes
            )
            continue
        if cfg.static_union and topk is not None:
            out[a:b] = _static_union(
                attend_absorbed_chunked,
                q_lat[a:b],
                q_rot[a:b],
                kv_store,
                keys,
                win,
                kv_lora,
                scale,
                cfg,
                min(L, (b - a) * topk),
            )
            continue
        union = win.any(0).nonzero().squeeze(1)  # [U] key indices, ascending
        if union.numel() > cfg.union_max_frac * L:
            out[a:b] = attend_absorbed_chunked(
                q_lat[a:b], q_rot[a:b], kv_store, keys, win, kv_lora, scale, cfg.gather_cap_bytes
            )
        else:
            out[a:b] = attend_absorbed_chunked(
                q_lat[a:b],
                q_rot[a:b],
                kv_store,
                keys.at(union),
                win[:, union],
                kv_lora,
                scale,
                cfg.gather_cap_bytes,
            )
    return out


def _static_union(
    attend_absorbed_chunked, q_lat, q_rot, kv_store, keys, win, kv_lora, scale, cfg, size
):
    """One window over the union of its selections, with static shapes: `size` bounds the union
    (rows x top-k), so the choice between the dense form and the union is made from shapes alone;
    the union's positions are found as selected_slots finds a row's (a top-k of the mask bytes,
    kept first, in key order), its unused places repeat the first kept key, masked.
    attend_absorbed_chunked: the backend's (it was the reference's, whatever the backend)."""
    L = win.shape[1]
    if size > cfg.union_max_frac * L:
        return attend_absorbed_chunked(
            q_lat, q_rot, kv_store, keys, win, kv_lora, scale, cfg.gather_cap_bytes
        )
    v, idx = win.any(0).view(torch.uint8).topk(size)
    order = torch.where(v.bool(), idx, idx + L).sort().values
    valid = order < L
    idx = torch.where(valid, order, order[:1])
    return attend_absorbed_chunked(
        q_lat,
        q_rot,
        kv_store,
        keys.at(idx),
        win[:, idx] & valid,
        kv_lora,
        scale,
        cfg.gather_cap_bytes,
    )


def gather_plan(
    cfg,
    context: int,
    chunk_tokens: int,
    dsa: DSAConfig,
    tp: int = 1,
    cache_itemsize: int = 2,
    batch: int = 1,
) -> list[tuple[str, int]]:
    """Every gather and capped temporary the sparse path makes for one prefill chunk at `context`
    keys and one decode step, as (what, bytes), from the same chunking functions the code calls.
    Shape arithmetic only: nothing is allocated, so it runs at the real GLM-5 sizes."""
    out = []
    h = cfg.num_attention_heads // tp
    width, iw = cfg.kv_cache_dim, cfg.index_head_dim
    rows = min(chunk_tokens, score_rows(dsa, context))
    out += [("indexer score rows (fp32 scores, int32 keys, masks)", rows * context * 9)]
    for a, b in index_key_chunks(
        rows, cfg.index_n_heads, context, iw * cache_itemsize, dsa.gather_cap_bytes
    )[:1]:
        out += [
            ("indexer key gather", (b - a) * iw * cache_itemsize),
            ("indexer key fp32 copy", (b - a) * iw * 4),
            ("indexer relu buffer", rows * cfg.index_n_heads * (b - a) * 4),
        ]
    win = min(dsa.window, chunk_tokens)
    for a, b in attn_key_chunks(win, h, context, width, cache_itemsize, dsa.gather_cap_bytes)[:1]:
        out += [
            ("prefill latent gather", (b - a) * width * cache_itemsize),
            ("prefill latent fp32 copy", (b - a) * width * 4),
            ("prefill scores", win * h * (b - a) * 4),
        ]
    k = min(cfg.index_topk, context)
    per_row = decode_row_bytes(k, h, width, cache_itemsize)
    for a, b in capped_chunks(batch, per_row, dsa.gather_cap_bytes)[:1]:
        out += [
            ("decode top-k gather", (b - a) * k * width * cache_itemsize),
            ("decode top-k fp32 copy", (b - a) * k * width * 4),
            ("decode scores", (b - a) * h * k * 4),
        ]
    return out
