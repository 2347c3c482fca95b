"""Capped gathers from the paged cache, and the byte sizes that split them.

Every gather of cache rows goes through `capped_chunks`: calls of at most `gather_cap_bytes`
each. Keys are addressed through the sequence's block table (`KeySlots`): a contiguous range of
keys is gathered by whole blocks (ranges then start on a block and span whole blocks, so the rows
materialised stay within the cap), a selection (top-k, a union) by the slots of its positions.
The attention references (ops/attention.py), the sparse path (model/dsa.py) and the hpu backend
size their chunks with these same functions.
"""

from __future__ import annotations

import torch

from dist_glm5.ops.key_slots import KeySlots

# Tests hook this to record every gather's size.
GATHER_LOG: list[int] | None = None


def capped_chunks(n_rows: int, row_bytes: int, cap: int) -> list[tuple[int, int]]:
    """Split n_rows into contiguous calls of at most `cap` bytes (at least one row per call)."""
    if row_bytes > cap:
        raise ValueError(
            f"one row of {row_bytes} bytes exceeds the gather cap of {cap} bytes: raise "
            "gather_cap_bytes"
        )
    per = max(1, cap // max(row_bytes, 1))
    return [(a, min(n_rows, a + per)) for a in range(0, n_rows, per)]


def gather_rows(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One gather call: store [S, D] rows at slots [...] -> [..., D]; callers keep it under the
    cap."""
    if GATHER_LOG is not None:
        GATHER_LOG.append(slots.numel() * store.shape[1] * store.element_size())
    return store[slots]


def key_ranges(n: int, per: int, block_size: int) -> list[tuple[int, int, bool]]:
    """Split a sequence's n keys into ranges of at most `per` rows, as (a, b, by_blocks).

    by_blocks: the range is read by whole blocks (one index per block, no per-position slots;
    its last block may be partial and is still read whole within `per` rows). That holds for one
    range whose blocks fit `per`, and for every range once `per` is rounded down to whole blocks;
    a budget under one block reads slot by slot."""
    whole = -(-n // block_size) * block_size
    if per >= n:
        return [(0, n, whole <= per)] if n else []
    if per < block_size:
        return [(a, min(n, a + per), False) for a in range(0, n, per)]
    per -= per % block_size
    return [(a, min(n, a + per), True) for a in range(0, n, per)]


def gather_keys(store: torch.Tensor, keys: KeySlots, a: int, b: int, by_blocks: bool):
    """Rows [b - a, D] of key positions a..b-1 (a range from `key_ranges`)."""
    if not by_blocks:
        return gather_rows(store, keys.range(a, b))
    bs, D = keys.block_size, store.shape[1]
    blocks = keys.table[a // bs : -(-b // bs)]
    if GATHER_LOG is not None:
        GATHER_LOG.append(blocks.numel() * bs * D * store.element_size())
    return store.view(-1, bs, D)[blocks].view(-1, D)[: b - a]


def attn_key_chunks(
    n: int, heads: int, K: int, width: int, itemsize: int, cap: int
) -> list[tuple[int, int]]:
    """Key chunks for n queries x heads: the gather ([chunk, width] stored), its fp32 copy and the
    [n, heads, chunk] fp32 scores and probabilities each stay under the cap."""
    return capped_chunks(K, attn_key_bytes(n, heads, width, itemsize), cap)


def attn_key_bytes(n: int, heads: int, width: int, itemsize: int) -> int:
    return max(width * max(itemsize, 4), n * heads * 4)


def decode_row_bytes(k: int, heads: int, width: int, itemsize: int) -> int:
    """Bytes per query row in the decode form: its k gathered rows (and their fp32 copy) or its
    scores."""
    return max(k * width * max(itemsize, 4), heads * k * 4)
