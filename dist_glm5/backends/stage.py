"""One pipeline stage's runtime: what a stage worker asks of its backend around the model. The
worker makes the same calls every step whatever the backend (stages/worker.py has no backend
branch); each backend's `stage` factory makes its runtime.

- `CpuStage` (the reference) adds nothing to the model: the cache on the host, filled by the
  plans' block tables; a step's metadata as the cache prepares it; no padding, no device copies,
  no warm-up.
- `HpuStage` (backends/hpu/stage.py) places the weights, the cache and the RoPE table on the
  device, pads each step to a bucket, copies the step's metadata to the device once, marks a step
  after every layer, and warms every bucket up when the stage starts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dist_glm5.model.kv_cache import Chunk, ForwardBatch, PagedKVCache


class StageRuntime(Protocol):
    def new_cache(self, cfg, layers: list[int], dtype: torch.dtype) -> PagedKVCache:
        """The stage's paged cache, where the model runs (tables come with the plans)."""

    def prepare(self, cache: PagedKVCache, chunks: list[Chunk]) -> ForwardBatch:
        """The step's metadata for the plan's chunks (a backend may pad them: the rows past
        `sum(c.length for c in chunks)` are never sampled), where the model runs."""

    def inputs(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """Rows of the plan's chunks (token ids, or the hidden rows the MTP layer takes) as the
        step of `tokens` rows that prepare() made, where the model runs."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache):
        """The stage's layers over one step: what the model returns."""

    def forward_mtp(
        self, next_ids: torch.Tensor, h: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """The MTP layer over one step (`batch` from prepare(), rows from inputs())."""

    def warmup(self, cache: PagedKVCache) -> list:
        """Run once when the stage starts, before the first plan; what was warmed, timed."""


class CpuStage:
    """The reference runtime: the model as loaded, on the host; every step exactly as planned."""

    def __init__(
        self,
        model,
        *,
        blocks: int,
        block_size: int,
        max_model_len: int | None = None,
        gather_cap_bytes: int | None = None,
        step_tokens: int | None = None,
        name: str = "stage",
    ):
        # the bucket and guard knobs are the device's (HpuStage): the host runs any shape
        self.model, self.blocks, self.block_size, self.name = model, blocks, block_size, name
        if max_model_len is not None:  # the RoPE table for the whole context, made once now
            model.rope.reserve(min(max_model_len, blocks * block_size))

    def new_cache(self, cfg, layers: list[int], dtype: torch.dtype) -> PagedKVCache:
        # not allocated: the tables come with the plans
        return PagedKVCache(
            cfg,
            layers,
            self.blocks,
            self.block_size,
            dtype=dtype,
            allocate=False,
            index_keys=self.model.dsa.index_keys,
        )

    def prepare(self, cache: PagedKVCache, chunks: list[Chunk]) -> ForwardBatch:
        return cache.prepare(chunks)

    def inputs(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        return x  # no padding: prepare() made exactly the plan's rows

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache):
        return self.model(x, batch, cache)

    def forward_mtp(
        self, next_ids: torch.Tensor, h: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        return self.model.mtp_forward(next_ids, h, batch, cache)

    def warmup(self, cache: PagedKVCache) -> list:
        return []  # nothing to compile or place
