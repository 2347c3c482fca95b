"""The GLM-5 model (or one pipeline stage of it) over the paged cache.

Module names mirror the HF checkpoint (`model.embed_tokens`, `model.layers.N...`, `model.norm`,
`lm_head`), so loading is a name lookup. A stage builds only its layer range: the first stage also
the embedding, the last also the final norm, lm_head and the MTP layer.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.kv_cache import ForwardBatch, PagedKVCache
from dist_glm5.model.layer import DecoderLayer
from dist_glm5.model.linear import Linear
from dist_glm5.model.mtp import MTPLayer
from dist_glm5.model.norm import RMSNorm
from dist_glm5.model.rope import RopeTable
from dist_glm5.ops import Ops


class Trunk(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        embed: bool,
        head: bool,
        mtp: bool,
        experts: range | None,
        ops: Ops,
        dsa: DSAConfig,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i, ops, experts, dsa) for i in layers}
        )
        if mtp:
            for j in range(cfg.num_nextn_predict_layers):
                n = cfg.num_hidden_layers + j
                self.layers[str(n)] = MTPLayer(cfg, n, ops, experts, dsa)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops) if head else None


class Glm5Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layers: range | None = None,
        embed: bool | None = None,
        head: bool | None = None,
        mtp: bool | None = None,
        experts: range | None = None,
        *,
        ops: Ops,
        dsa: DSAConfig | None = None,
    ):
        """ops: the hot ops every layer runs (dist_glm5.ops.Ops), chosen by whoever builds the
        model (a worker: its backend's; a test or tool: `get_backend("cpu").ops()` or
        `reference_ops()`): the model picks no backend itself. dsa: how attention runs (the
        dense masked reference by default, or the scaled sparse path), fixed at build time."""
        super().__init__()
        n = cfg.num_hidden_layers
        layers = range(n) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > n or len(layers) == 0:
            raise ValueError(
                f"layer range {layers} must be a non-empty contiguous part of 0..{n - 1}"
            )
        self.cfg = cfg
        self.layer_range = layers
        embed = layers.start == 0 if embed is None else embed
        head = layers.stop == n if head is None else head
        mtp = head and cfg.num_nextn_predict_layers > 0 if mtp is None else mtp
        embed = embed or mtp  # the MTP layer embeds the next token with the shared embedding
        self.experts = (
            range(cfg.n_routed_experts) if experts is None else experts
        )  # this EP rank's routed experts
        if (
            self.experts.step != 1
            or self.experts.start < 0
            or self.experts.stop > cfg.n_routed_experts
            or not self.experts
        ):
            raise ValueError(
                f"expert range {experts} must be a non-empty contiguous part of "
                f"0..{cfg.n_routed_experts - 1}"
            )
        self.ops = ops
        self.dsa = dsa or DSAConfig()
        self.model = Trunk(cfg, layers, embed, head, mtp, self.experts, self.ops, self.dsa)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, ops) if head else None
        self.has_mtp = mtp
        self.rope = RopeTable(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        # the backend's planned decode step (Ops.decode_plan), made at the first forward: after
        # loading and any tensor-parallel split; False: none for this model
        self._plan = None
        self.profiler = None  # obs/profiler.install's (the plan opens its spans)

    def _apply(self, fn, recurse=True):
        self._plan = None  # .to() and the like may move the weights the plan points at
        return super()._apply(fn, recurse)

    # ---- what this model (stage) owns --------------------------------------------------
    @property
    def cache_layers(self) -> list[int]:
        return [int(k) for k in self.model.layers.keys()]

    def mtp_layer(self, j: int = 0) -> MTPLayer:
        return self.model.layers[str(self.cfg.num_hidden_layers + j)]

    def new_cache(self, num_blocks: int, block_size: int = 64) -> PagedKVCache:
        return PagedKVCache(
            self.cfg,
            self.cache_layers,
            num_blocks,
            block_size,
            dtype=self.dtype,
            index_keys=self.dsa.index_keys,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.layers[str(self.layer_range.start)].input_layernorm.weight.dtype

    # ---- forward ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        keep: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Run this stage's layers. x: token ids [T] (first stage) or residual hidden [T, H].

        Returns the residual stream after the last owned layer (before the final norm) and the
        last DSA selection (for a following stage whose first layer is 'shared').
        """
        if self._planned():
            out = self._plan(x, batch, cache, keep)
            if out is not None:
                return out
        if x.dtype in (torch.int64, torch.int32):
            x = self.embed(x.long())
        cos, sin = self.rope.lookup(batch.positions)
        for i in self.layer_range:
            x, keep = self.model.layers[str(i)](x, batch, cache, cos, sin, keep)
        return x, keep

    def _planned(self) -> bool:
        """Whether the backend planned this model's decode steps (made on first use)."""
        if self._plan is None:
            plan = self.ops.decode_plan
            self._plan = (plan(self) if plan is not None else None) or False
        return bool(self._plan)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        # [n, H] -> [n, V] fp32
        return self._head(self.lm_head, h_normed)

    def _head(self, lin, h: torch.Tensor) -> torch.Tensor:
        """An output head's fp32 logits: the planned product when the backend planned one
        (the same kernel, same bits), else the module."""
        if self._planned():
            out = self._plan.head(lin, h)
            if out is not None:
                return out
        return lin(h).float()

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        h_normed: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        j: int = 0,
    ) -> torch.Tensor:
        """MTP rows at the batch's positions: next_ids [T] (token i+1 for row i),
        h_normed [T, H] -> [T, H] normed."""
        if j == 0 and self._planned():
            out = self._plan.mtp(next_ids, h_normed, batch, cache)
            if out is not None:
                return out
        layer = self.mtp_layer(j)
        emb = (layer.embed_tokens or self.model.embed_tokens)(next_ids.long())
        cos, sin = self.rope.lookup(batch.positions)
        return layer.forward_mtp(emb, h_normed, batch, cache, cos, sin)

    def mtp_logits(self, h_mtp: torch.Tensor, j: int = 0) -> torch.Tensor:
        head = self.mtp_layer(j).shared_head.head or self.lm_head
        return self._head(head, h_mtp)
