"""One pipeline stage on Gaudi: what a stage worker does differently from the CPU reference.

`HpuStage(model, ...)` (the backend's `stage` factory; stages/worker.py asks for it):
- places the weights on the device, builds the paged cache there, and swaps the host RoPE table
  for the device table (norm_rope.DeviceRopeTable: no growth and no `.max()` inside a step);
- copies each step's index metadata (positions, slots, block tables, groups), made on the host
  from the plan, to the device once;
- lazy mode: a mark_step after every decoder layer (runtime.add_layer_mark_steps) and after the
  MTP layer. The model is not captured as HPU graphs: a step's Python control flow (per-sequence
  groups, capped chunks) still depends on the plan, which a replayed graph would ignore;
- pads each sequence's context (its key count) to a context bucket of whole blocks
  (buckets `decode_ctx`), masked by causality (`pad_context`); the cache is zeroed once, so the
  masked slots are finite;
- pads each step's token count (the layers' and the MTP layer's) to a bucket
  (buckets.BucketConfig.step_tokens): the padding is one chunk of a scratch sequence at positions
  0..P-1 in blocks of its own, past the scheduler's blocks. It writes its keys before it attends
  to them (never a read of an unwritten slot), attends causally to itself (never a fully masked
  row), and every stage pads the same plan the same way, so the hidden states sent between stages
  have the padded shape. Its rows are never sampled (the worker samples the plan's chunks only);
- warm-up (warmup.warmup): one step of every (tokens, context) bucket (layers and MTP layer),
  run once when the stage starts;
- optionally runs each step under the dispatch guard (`DIST_GLM5_HPU_GUARD=<dir>`: one JSON line
  per step to <dir>/guard-s<stage>-r<rank>.jsonl). A diagnostic: it reads values, so it syncs.

Not yet static: a step's number of attention groups and of capped chunks still follows the plan
(one graph per combination on the card, all from bucketed shapes); warm-up runs one chunk per
bucket.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dist_glm5.model.kv_cache import Chunk, ForwardBatch, KeySlots, PagedKVCache

from . import runtime, warmup
from .buckets import BucketConfig, find_bucket
from .guard import StepGuard
from .norm_rope import DeviceRopeTable

log = logging.getLogger(__name__)
GUARD_ENV = "DIST_GLM5_HPU_GUARD"
PAD_SEQ = -1  # the scratch sequence's id: the scheduler's ids are >= 0
WARM_SEQ = -2  # the warm-up's sequence, over the scheduler's blocks before the first plan


def _storage(cache: PagedKVCache) -> list[torch.Tensor]:
    """Every tensor the cache keeps keys in (latent KV and indexer keys, per layer)."""
    return [*cache.kv.values(), *cache.index_k.values()]


class HpuStage:
    def __init__(
        self,
        model,
        device: str,
        *,
        blocks: int,
        block_size: int,
        max_model_len: int,
        gather_cap_bytes: int,
        step_tokens: int | None = None,
        name: str = "stage",
        buckets: BucketConfig | None = None,
    ):
        self.model, self.device, self.name = model, torch.device(device), name
        if model.dsa.index_keys != "exact":
            raise ValueError(
                f"index_keys {model.dsa.index_keys!r} has no Gaudi kernel: run the hpu backend "
                "with exact index keys (drop --index-keys int8)"
            )
        self.first = model.layer_range.start == 0  # token ids in, else hidden states
        self.buckets = buckets or BucketConfig.from_env(
            block_size=block_size, max_model_len=max_model_len
        )
        self.tokens = self.buckets.step_tokens()
        self.ctx = self.buckets.table("decode_ctx")  # context blocks of every step's sequences
        if self.ctx[-1] * block_size < self.tokens[-1]:
            raise ValueError(
                f"the largest context bucket ({self.ctx[-1]} blocks of {block_size}) is shorter "
                f"than the largest token bucket ({self.tokens[-1]}): raise the context "
                "(DIST_GLM5_DECODE_CTX_BUCKET_MAX, --ctx) or lower "
                "DIST_GLM5_PROMPT_QUERY_BUCKET_MAX"
            )
        if step_tokens is not None and step_tokens > self.tokens[-1]:
            raise ValueError(
                f"the scheduler plans steps of up to {step_tokens} tokens but the largest token "
                f"bucket is {self.tokens[-1]}: raise DIST_GLM5_PROMPT_QUERY_BUCKET_MAX or lower "
                "the step token budget"
            )
        self.blocks, self.block_size = blocks, block_size
        self.scratch = -(-self.tokens[-1] // block_size)  # blocks of the largest pad chunk
        self.gather_cap = gather_cap_bytes
        model.to(self.device)
        # positions a sequence can reach (the context, within what the cache holds) and those of
        # the largest scratch step
        positions = max(min(max_model_len, blocks * block_size), self.tokens[-1])
        model.rope = DeviceRopeTable.from_host(model.rope, positions, self.device)
        runtime.add_layer_mark_steps([model.model.layers[str(i)] for i in model.layer_range])
        guard = os.environ.get(GUARD_ENV)
        self.guard_file = Path(guard) / f"guard-{name}.jsonl" if guard else None
        self.steps = 0

    def new_cache(self, cfg, layers: list[int], dtype: torch.dtype) -> PagedKVCache:
        """The stage's paged cache on the device: the scheduler's blocks, then the scratch blocks
        the padding writes to."""
        cache = PagedKVCache(
            cfg,
            layers,
            self.blocks + self.scratch,
            self.block_size,
            dtype=dtype,
            allocate=False,
            device=self.device,
        )
        cache.assign(PAD_SEQ, list(range(self.blocks, self.blocks + self.scratch)))
        # zeros, not empty: a padded context reads slots no token wrote (masked, but 0 x NaN is NaN)
        for t in _storage(cache):
            t.zero_()
        return cache

    # ---- one step --------------------------------------------------------------------------
    def prepare(self, cache: PagedKVCache, chunks: list[Chunk]) -> ForwardBatch:
        """The step's metadata for the plan's chunks padded to a bucket, on the device."""
        return self.on_device(cache.prepare(self.pad(chunks)))

    def on_device(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch's index tensors (made on the host from the plan) copied to the device once
        per step, so no layer mixes host and device tensors; each sequence's context padded to a
        context bucket."""
        dev = self.device
        keys = {id(k): self.pad_context(k, dev) for k in batch.keys}
        groups = [
            replace(
                g,
                tok=g.tok.to(dev),
                valid=g.valid.to(dev),
                q_pos=g.q_pos.to(dev),
                real=g.real.to(dev),
                keys=[keys[id(k)] for k in g.keys],
            )
            for g in batch.groups
        ]
        return replace(
            batch,
            positions=batch.positions.to(dev),
            write_slots=batch.write_slots.to(dev),
            keys=[keys[id(k)] for k in batch.keys],
            groups=groups,
        )

    def pad_context(self, keys: KeySlots, device) -> KeySlots:
        """A sequence's keys 0..L-1 as keys 0..C-1, C a context bucket (whole blocks): positions
        past L sit after every query of the step, so the causal mask removes them (selection and
        attention alike, the padded step computes the same values) and a row keeps its own key.
        Table entries past the sequence's own blocks name the first scratch block (written,
        finite)."""
        bs = self.block_size
        blocks = find_bucket(self.ctx, -(-len(keys) // bs), "context (blocks)")
        table = keys.table
        if table.shape[0] < blocks:
            table = torch.cat([table, table.new_full((blocks - table.shape[0],), self.blocks)])
        return replace(keys, table=table.to(device), length=blocks * bs)

    def pad(self, chunks: list[Chunk]) -> list[Chunk]:
        """The plan's chunks and, unless their token count is a bucket, one scratch chunk filling
        it up to the next bucket."""
        n = sum(c.length for c in chunks)
        p = find_bucket(self.tokens, n, "tokens in one step (raise the token buckets)") - n
        return chunks + [Chunk(PAD_SEQ, 0, p)] if p else chunks

    def inputs(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """Rows of the plan's chunks (token ids, or the hidden rows the MTP layer takes) padded
        with zeros to the step's bucket, on the device."""
        pad = tokens - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x.to(self.device)

    def forward(self, x: torch.Tensor, batch, cache: PagedKVCache):
        """The stage's layers over one padded step."""
        return self._guarded("layers", self.model, x, batch, cache)

    def forward_mtp(self, next_ids: torch.Tensor, h: torch.Tensor, batch, cache: PagedKVCache):
        """The MTP layer over one padded step (`batch` from prepare(); rows from inputs())."""
        out = self._guarded("mtp", self.model.mtp_forward, next_ids, h, batch, cache)
        runtime.mark_step()  # forward_mtp is not a module call: no layer hook fires
        return out

    def _guarded(self, what: str, fn, *args):
        self.steps += 1
        if self.guard_file is None:
            return fn(*args)
        cache = args[-1]
        guard = StepGuard(self.gather_cap, _storage(cache))
        with guard:
            out = fn(*args)
        self.guard_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.guard_file, "a") as f:
            found = [asdict(v) for v in guard.violations]
            rec = {
                "step": self.steps,
                "what": what,
                "tokens": args[-2].num_tokens,
                "keys": sorted({len(k) for k in args[-2].keys}),
                "ops": guard.ops,
                "violations": found,
            }
            f.write(json.dumps(rec) + "\n")
        if guard.violations:
            log.warning(
                "%s: step %d: %d guard finding(s), first %s",
                self.name,
                self.steps,
                len(guard.violations),
                guard.violations[0],
            )
        return out

    # ---- warm-up ---------------------------------------------------------------------------
    def warm_buckets(self) -> list[tuple[int, int]]:
        """(tokens, context blocks) of one chunk: every token bucket at every context bucket that
        holds it and fits this stage's cache (a larger context cannot occur)."""
        bs = self.block_size
        return [(t, c) for c in self.ctx if c <= self.blocks for t in self.tokens if t <= c * bs]

    def warmup(self, cache: PagedKVCache) -> list[warmup.BucketTime]:
        """One step of every (tokens, context) bucket through this stage's layers and MTP layer,
        each timed against the driver's lock-up timer. The cache is empty before the first plan:
        a warm-up chunk ends at its context bucket in the scheduler's first blocks (zeros in,
        results discarded), and the cache is zeroed again afterwards."""
        H, bs, buckets = self.model.cfg.hidden_size, self.block_size, self.warm_buckets()
        if not buckets:
            return []
        cache.assign(WARM_SEQ, list(range(max(c for _, c in buckets))))

        def run(bucket: tuple[int, int]) -> None:
            tokens, blocks = bucket
            batch = self.on_device(cache.prepare([Chunk(WARM_SEQ, blocks * bs - tokens, tokens)]))
            ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
            h = torch.zeros(tokens, H, dtype=self.model.dtype, device=self.device)
            with torch.no_grad():
                self.model(ids if self.first else h, batch, cache)
                if self.model.has_mtp:  # the last stage's MTP layer, same bucket
                    self.model.mtp_forward(ids, h, batch, cache)

        try:
            times = warmup.warmup(buckets, run)
        finally:
            cache.release(WARM_SEQ)
            for t in _storage(cache):
                t.zero_()
        log.info(
            "%s: warm-up of %d (tokens, context blocks) buckets in %.1f s",
            self.name,
            len(times),
            sum(t.seconds for t in times),
        )
        return times
