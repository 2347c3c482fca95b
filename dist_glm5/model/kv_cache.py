"""Paged KV cache: fixed-size blocks, a block table per sequence.

Per layer it holds, for every token slot, the MLA cache row [normalised latent | roped shared key]
(kv_lora_rank + qk_rope_head_dim values) and, for layers that run an indexer, the indexer key
(index_head_dim values). Storage is flat [num_blocks * block_size, D];
slot = block_table[pos // block_size] * block_size + pos % block_size.

A worker's cache is storage plus the block tables it is sent (the scheduler's ledger decides, see
block_manager.py). A standalone cache (tests, the single-process loop) allocates for itself.

Per-step metadata is O(batch + new tokens): each chunk gets its sequence's block table (a view of
a table kept between steps, grown by the blocks a plan sends) and its length, never a list of
every position's slot. Attention gathers from the tables (`KeySlots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dist_glm5.model.block_manager import BlockManager, CacheFullError
from dist_glm5.model.config import ModelConfig
from dist_glm5.ops.key_slots import KeySlots, RowsKeys
from dist_glm5.quant import index_q8

__all__ = ["CacheFullError", "Chunk", "ForwardBatch", "KeySlots", "PagedKVCache"]


class _Table:
    """A sequence's block table as a growing int64 tensor (capacity doubles: appends are O(new))."""

    def __init__(self) -> None:
        self.t = torch.empty(8, dtype=torch.int64)
        self.n = 0
        self.first: int | None = None  # block 0 on the host
        self.blocks: list[int] = []  # the whole table on the host: a decode chunk's slots as ints

    def extend(self, blocks: list[int]) -> None:
        if self.n + len(blocks) > self.t.shape[0]:
            grown = torch.empty(max(2 * self.t.shape[0], self.n + len(blocks)), dtype=torch.int64)
            grown[: self.n] = self.t[: self.n]
            self.t = grown
        self.t[self.n : self.n + len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        if self.n == 0:
            self.first = blocks[0]
        self.n += len(blocks)
        self.blocks += blocks

    def view(self) -> torch.Tensor:
        return self.t[: self.n]


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
    keys: list[KeySlots]  # per chunk, its key positions 0..end-1
    real: torch.Tensor | None = None  # [R] flat indices (b * n + j) of the valid rows, host-made
    counts: list[int] | None = None  # per chunk, its real rows
    _slots: torch.Tensor | None = None
    _rows_keys: RowsKeys | None = None
    _real_rows: tuple[list[int], list[int]] | None = None  # the real rows' tok, q_pos as ints

    @property
    def rows_keys(self) -> RowsKeys:
        """The real rows, flat, and every chunk's keys: a batched selection's input. Built on
        first use, once per forward (every full layer reads it)."""
        if self._rows_keys is None:
            if self._real_rows is not None:
                tok, q_pos = (torch.tensor(x, dtype=torch.int64) for x in self._real_rows)
            else:
                tok, q_pos = self.tok.reshape(-1)[self.real], self.q_pos.reshape(-1)[self.real]
            self._rows_keys = RowsKeys.of(tok, q_pos, self.counts, self.keys)
        return self._rows_keys

    @property
    def slots(self) -> torch.Tensor:
        """[B, L] slots of every key position, padded: the dense reference's gather (it reads
        every key anyway). Built on first use, once per forward."""
        if self._slots is None:
            L = max(len(k) for k in self.keys)
            s = torch.empty(len(self.keys), L, dtype=torch.int64, device=self.keys[0].table.device)
            for r, k in enumerate(self.keys):
                s[r] = k.first
                s[r, : len(k)] = k.range(0, len(k))
            self._slots = s
        return self._slots


@dataclass
class ForwardBatch:
    """Per-forward metadata shared by every layer of a stage."""

    chunks: list[Chunk]
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] slots the new tokens are written to
    keys: list[KeySlots]  # per chunk: its key positions 0..end-1
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
        allocate: bool = True,
        device: torch.device | str | None = None,
        index_keys: str = "exact",
    ):
        """allocate: a standalone cache that grows tables itself in prepare(); a worker's cache
        (allocate=False) only holds the tables its plans send (`assign`). device: where the
        storage lives (default: the CPU); block tables and metadata stay on the host. index_keys:
        "int8" keeps the indexer's keys as quant/index_q8.py rows (else in `dtype`)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ledger = BlockManager(num_blocks, block_size) if allocate else None
        n = num_blocks * block_size
        # empty, not zeros: only written slots are ever read (padding repeats a written slot), and
        # untouched pages of a long-context cache then cost no memory until used
        self.kv = {l: torch.empty(n, cfg.kv_cache_dim, dtype=dtype, device=device) for l in layers}

        def index_store() -> torch.Tensor:
            if index_keys == "int8":
                return index_q8.empty_store(n, cfg.index_head_dim, device=device)
            return torch.empty(n, cfg.index_head_dim, dtype=dtype, device=device)

        self.index_k = {l: index_store() for l in layers if cfg.has_indexer(l)}
        self.tables: dict[int, _Table] = {}

    def assign(self, seq_id: int, blocks: list[int]) -> None:
        """Append `blocks` (ids the scheduler gave this sequence) to its table."""
        if not blocks:
            return
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"sequence {seq_id} was sent cache blocks {bad[:5]} outside "
                f"0..{self.num_blocks - 1}: the coordinator and the workers disagree on the cache"
            )
        self.tables.setdefault(seq_id, _Table()).extend(blocks)

    def prepare(self, chunks: list[Chunk]) -> ForwardBatch:
        """The forward's metadata: positions, write slots, each chunk's block table and length.
        A decode or verify chunk's (at most SMALL_CHUNK tokens) are Python ints, made into one
        tensor per field: the per-chunk arange/index/cat ran about 25 us a sequence."""
        bs = self.block_size
        pos, write, keys, spans, t = [], [], [], [], 0
        for c in chunks:
            if c.length <= 0:
                raise ValueError(f"chunk for sequence {c.seq_id} has no tokens")
            if self.ledger is not None:
                self.assign(c.seq_id, self.ledger.grow(c.seq_id, c.end))
            table = self.tables.get(c.seq_id)
            if table is None or table.n * self.block_size < c.end:
                have = 0 if table is None else table.n * self.block_size
                raise ValueError(
                    f"sequence {c.seq_id} writes positions up to {c.end - 1} but its block table "
                    f"covers {have}: the plan did not send its blocks"
                )
            k = KeySlots(table.view(), bs, c.end, table.first)
            if c.length <= SMALL_CHUNK:
                ps = range(c.start, c.end)
                pos.append(list(ps))
                write.append([table.blocks[p // bs] * bs + p % bs for p in ps])
            else:
                p = torch.arange(c.start, c.end, dtype=torch.int64)
                pos.append(p)
                write.append(k.at(p))
            keys.append(k)
            spans.append((t, t + c.length))
            t += c.length
        return ForwardBatch(
            chunks, _flat(pos), _flat(write), keys, spans, make_groups(chunks, keys, spans)
        )

    def release(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)
        if self.ledger is not None:
            self.ledger.release(seq_id)


def _flat(parts: list) -> torch.Tensor:
    """Lists of ints and int64 tensors, in order, as one int64 tensor."""
    if all(isinstance(x, list) for x in parts):
        return torch.tensor([v for x in parts for v in x], dtype=torch.int64)
    return torch.cat(
        [torch.tensor(x, dtype=torch.int64) if isinstance(x, list) else x for x in parts]
    )


def _small_group(ids: list[int], chunks: list[Chunk], spans, keys) -> AttnGroup:
    """Decode and verify chunks, padded to n rows, as ints: one tensor per field."""
    n = max(chunks[i].length for i in ids)
    tok, q_pos, valid, real, real_tok, real_pos = [], [], [], [], [], []
    for r, i in enumerate(ids):
        c, a, m = chunks[i], spans[i][0], chunks[i].length
        tok.append([*range(a, a + m)] + [a] * (n - m))  # pad rows repeat the first token
        q_pos.append([*range(c.start, c.end)] + [c.start] * (n - m))
        valid.append([True] * m + [False] * (n - m))
        real += range(r * n, r * n + m)
        real_tok += range(a, a + m)
        real_pos += range(c.start, c.end)
    return AttnGroup(
        ids,
        torch.tensor(tok, dtype=torch.int64),
        torch.tensor(valid, dtype=torch.bool),
        torch.tensor(q_pos, dtype=torch.int64),
        [keys[i] for i in ids],
        torch.tensor(real, dtype=torch.int64),
        [chunks[i].length for i in ids],
        _real_rows=(real_tok, real_pos),
    )


def _long_group(i: int, chunks: list[Chunk], spans, keys) -> AttnGroup:
    """A prefill chunk (more than SMALL_CHUNK tokens), attended alone: no padding."""
    c, (a, b) = chunks[i], spans[i]
    return AttnGroup(
        [i],
        torch.arange(a, b).unsqueeze(0),
        torch.ones(1, c.length, dtype=torch.bool),
        torch.arange(c.start, c.end).unsqueeze(0),
        [keys[i]],
        torch.arange(c.length),
        [c.length],
    )


def make_groups(
    chunks: list[Chunk], keys: list[KeySlots], spans: list[tuple[int, int]]
) -> list[AttnGroup]:
    """Each prefill chunk its own group, then the decode and verify chunks as one."""
    out = [
        _long_group(i, chunks, spans, keys) for i, c in enumerate(chunks) if c.length > SMALL_CHUNK
    ]
    small = [i for i, c in enumerate(chunks) if c.length <= SMALL_CHUNK]
    if small:
        out.append(_small_group(small, chunks, spans, keys))
    return out
