"""Paged KV cache: fixed-size blocks, a block table per sequence.

Per layer it holds, for every token slot, the MLA cache row [normalised latent | roped shared key]
(kv_lora_rank + qk_rope_head_dim values) and, for layers that run an indexer, the indexer key
(index_head_dim values). Storage is flat [num_blocks * block_size, D] so a gather is one
index_select over slot ids; slot = block_table[pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dist_glm5.model.config import ModelConfig


class CacheFullError(RuntimeError):
    """No free blocks left: the request does not fit the planned cache."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"cache needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}

    def ensure(self, seq_id: int, length: int) -> list[int]:
        """Grow `seq_id`'s block table to hold `length` tokens."""
        table = self.tables.setdefault(seq_id, [])
        need = -(-length // self.block_size) - len(table)
        if need > len(self.free):
            raise CacheFullError(
                f"sequence {seq_id} needs {need} more cache blocks for {length} tokens, "
                f"{len(self.free)} free of {self.num_blocks}: lower the context or batch, or plan "
                "a larger cache"
            )
        for _ in range(max(need, 0)):
            table.append(self.free.pop())
        return table

    def release(self, seq_id: int) -> None:
        for b in reversed(self.tables.pop(seq_id, [])):
            self.free.append(b)

    def slots(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        # positions: [n] int64 -> flat slot ids [n]
        table = torch.tensor(self.tables[seq_id], dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass(frozen=True)
class Chunk:
    """One sequence's new tokens in a forward: positions start .. start+length-1."""

    seq_id: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


# Chunks with at most this many new tokens (decode, MTP verification) are attended together,
# padded to one [B, n, L] batch; longer chunks (prefill) are attended one at a time.
SMALL_CHUNK = 8


@dataclass
class AttnGroup:
    """Chunks attended together, padded: B chunks, n query rows, L key rows each.

    Pad query rows repeat the chunk's first token (their output is dropped); pad key rows repeat
    its first slot and sit after every real query position, so the causal mask removes them and
    no row is ever fully masked (no 0/0).
    """

    chunk_ids: list[int]
    tok: torch.Tensor  # [B, n] index into the forward's T tokens
    valid: torch.Tensor  # [B, n] real query rows
    q_pos: torch.Tensor  # [B, n] absolute query positions
    slots: torch.Tensor  # [B, L] cache slots of key positions 0..L-1


@dataclass
class ForwardBatch:
    """Per-forward metadata shared by every layer of a stage."""

    chunks: list[Chunk]
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] slots the new tokens are written to
    read_slots: list[torch.Tensor]  # per chunk [end] slots of positions 0..end-1
    spans: list[tuple[int, int]] = field(default_factory=list)  # per chunk token range in [T]
    groups: list[AttnGroup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[int],
        num_blocks: int,
        block_size: int = 64,
        dtype: torch.dtype = torch.float32,
    ):
        self.alloc = BlockAllocator(num_blocks, block_size)
        n = num_blocks * block_size
        # empty, not zeros: only written slots are ever read (padding repeats a written slot), and
        # untouched pages of a long-context cache then cost no memory until used
        self.kv = {l: torch.empty(n, cfg.kv_cache_dim, dtype=dtype) for l in layers}
        self.index_k = {
            l: torch.empty(n, cfg.index_head_dim, dtype=dtype) for l in layers if cfg.has_indexer(l)
        }
        self.lengths: dict[int, int] = {}

    @property
    def block_size(self) -> int:
        return self.alloc.block_size

    def prepare(self, chunks: list[Chunk]) -> ForwardBatch:
        """Reserve room for every chunk and compute its slots."""
        pos, write, read, spans, t = [], [], [], [], 0
        for c in chunks:
            if c.length <= 0:
                raise ValueError(f"chunk for sequence {c.seq_id} has no tokens")
            self.alloc.ensure(c.seq_id, c.end)
            p = torch.arange(c.start, c.end, dtype=torch.int64)
            pos.append(p)
            write.append(self.alloc.slots(c.seq_id, p))
            read.append(self.alloc.slots(c.seq_id, torch.arange(c.end, dtype=torch.int64)))
            spans.append((t, t + c.length))
            t += c.length
        for c in chunks:  # a rejected draft rolls back simply by starting the next chunk earlier
            self.lengths[c.seq_id] = c.end
        return ForwardBatch(
            chunks, torch.cat(pos), torch.cat(write), read, spans, make_groups(chunks, read, spans)
        )

    def release(self, seq_id: int) -> None:
        self.alloc.release(seq_id)
        self.lengths.pop(seq_id, None)


def make_groups(
    chunks: list[Chunk], read: list[torch.Tensor], spans: list[tuple[int, int]]
) -> list[AttnGroup]:
    small = [i for i, c in enumerate(chunks) if c.length <= SMALL_CHUNK]
    groups = [[i] for i, c in enumerate(chunks) if c.length > SMALL_CHUNK]
    if small:
        groups.append(small)
    out = []
    for ids in groups:
        n = max(chunks[i].length for i in ids)
        L = max(chunks[i].end for i in ids)
        tok = torch.empty(len(ids), n, dtype=torch.int64)
        q_pos = torch.empty(len(ids), n, dtype=torch.int64)
        slots = torch.empty(len(ids), L, dtype=torch.int64)
        valid = torch.zeros(len(ids), n, dtype=torch.bool)
        for r, i in enumerate(ids):
            c, (a, b), rs = chunks[i], spans[i], read[i]
            tok[r] = a
            tok[r, : c.length] = torch.arange(a, b)
            q_pos[r] = c.start
            q_pos[r, : c.length] = torch.arange(c.start, c.end)
            valid[r, : c.length] = True
            slots[r] = rs[0]
            slots[r, : c.end] = rs
        out.append(AttnGroup(ids, tok, valid, q_pos, slots))
    return out
