"""Where a sequence's keys live in the paged cache: its block table and length.

Here, not beside the cache (model/kv_cache.py builds them), because the attention references in
ops/ gather through it and ops/ imports nothing from model/.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeySlots:
    """Where one sequence's key positions 0..length-1 live: its block table and length.

    Slots are computed for the positions a gather touches; a contiguous range is gathered by
    whole blocks (see `ops.gather.gather_keys`)."""

    table: torch.Tensor  # [blocks] int64, covering at least `length` positions
    block_size: int
    length: int
    first_block: int | None = None  # table[0] known on the host (no read of the table)

    def __len__(self) -> int:
        return self.length

    def at(self, pos: torch.Tensor) -> torch.Tensor:
        """Slots of key positions `pos` (any shape, int64)."""
        bs = self.block_size
        return self.table[pos // bs] * bs + pos % bs

    def range(self, a: int, b: int) -> torch.Tensor:
        return self.at(torch.arange(a, b, dtype=torch.int64, device=self.table.device))

    @property
    def first(self) -> int:
        """The slot of position 0 (always written: padding repeats it). From the host copy of
        the first block when the cache gave it: a device graph reads no value back."""
        b = self.first_block if self.first_block is not None else int(self.table[0])
        return b * self.block_size


@dataclass(frozen=True)
class RowsKeys:
    """Several sequences' query rows, flat, with each sequence's keys: what one batched selection
    reads for a whole decode batch (built once per forward, read by every full layer). Sequence s
    owns rows [row_off[s], row_off[s + 1]) and its lengths[s] keys through the block table at
    tables[tab_off[s]:]."""

    tok: torch.Tensor  # [R] int64: each row's token in the forward
    q_pos: torch.Tensor  # [R] int64
    row_off: torch.Tensor  # [S + 1] int32
    tables: torch.Tensor  # [total blocks] int64: the block tables, one after another
    tab_off: torch.Tensor  # [S] int64
    lengths: torch.Tensor  # [S] int64
    block_size: int

    @classmethod
    def of(cls, tok, q_pos, counts: list[int], keys: list[KeySlots]):
        """tok, q_pos [R] the real rows' (flat, sequence after sequence); counts[b] real rows of
        sequence b."""
        sizes = [len(k.table) for k in keys]
        tables = keys[0].table if len(keys) == 1 else torch.cat([k.table for k in keys])
        return cls(
            tok,
            q_pos,
            torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32),
            tables if tables.dtype == torch.int64 else tables.to(torch.int64),
            torch.tensor([0, *itertools.accumulate(sizes)][:-1], dtype=torch.int64),
            torch.tensor([len(k) for k in keys], dtype=torch.int64),
            keys[0].block_size,
        )
