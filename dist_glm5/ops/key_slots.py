"""Where a sequence's keys live in the paged cache: its block table and length.

Here, not beside the cache (model/kv_cache.py builds them), because the attention references in
ops/ gather through it and ops/ imports nothing from model/.
"""

from __future__ import annotations

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
