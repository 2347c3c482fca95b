"""The block ledger: which KV-cache blocks each sequence holds (pure Python: no torch here).

Every worker of a deployment has a cache of the same number of blocks of the same size, so one
ledger describes them all: the scheduler owns it (admission, growth, preemption, release) and
plans carry the block ids each stage writes; workers keep storage plus the tables they are sent.
A standalone cache (tests, the single-process loop) keeps a ledger of its own.
"""

from __future__ import annotations


class CacheFullError(RuntimeError):
    """No free blocks left: the request does not fit the planned cache."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"cache needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by sequences."""
        return 1.0 - len(self.free) / self.num_blocks

    @property
    def capacity(self) -> int:
        """Tokens the whole cache holds: the most one sequence can ever use."""
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def need(self, seq_id: int, tokens: int) -> int:
        """Blocks `seq_id` lacks to hold `tokens` positions (0 when it already does)."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq_id, ())))

    def grow(self, seq_id: int, tokens: int) -> list[int]:
        """Extend `seq_id`'s table to hold `tokens` positions; returns the blocks added."""
        need = self.need(seq_id, tokens)
        if need > len(self.free):
            raise CacheFullError(
                f"sequence {seq_id} needs {need} more cache blocks for {tokens} tokens, "
                f"{len(self.free)} free of {self.num_blocks}: lower the context or batch, or plan "
                "a larger cache"
            )
        new = [self.free.pop() for _ in range(need)]
        self.tables.setdefault(seq_id, []).extend(new)
        return new

    def release(self, seq_id: int) -> int:
        """Free every block of `seq_id`; returns how many."""
        table = self.tables.pop(seq_id, [])
        self.free.extend(reversed(table))
        return len(table)

    def reset(self) -> None:
        """Every block free (the workers' caches were lost: a restarted pipeline)."""
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.tables.clear()
