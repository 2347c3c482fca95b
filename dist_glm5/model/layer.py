"""One decoder block: pre-norm MLA (+ DSA) and a dense MLP or MoE, each with a residual."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.kv_cache import ForwardBatch, PagedKVCache
from dist_glm5.model.mla import MLA
from dist_glm5.model.moe import MLP, MoE
from dist_glm5.model.norm import RMSNorm
from dist_glm5.ops import Ops


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        ops: Ops,
        experts: range | None = None,
        dsa: DSAConfig | None = None,
    ):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = MLA(cfg, layer, ops, dsa)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = (
            MoE(cfg, ops, experts)
            if cfg.is_moe_layer(layer)
            else MLP(cfg.hidden_size, cfg.intermediate_size, ops)
        )
        # Sums of partial outputs over a stage's tensor/expert-parallel ranks (set by stages/tp.py).
        self.attn_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.mlp_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prev_keep: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # x: [T, H] residual stream
        a, keep = self.self_attn(self.input_layernorm(x), batch, cache, cos, sin, prev_keep)
        if self.attn_reduce is not None:
            a = self.attn_reduce(a)
        x = x + a
        m = self.mlp(self.post_attention_layernorm(x))
        if self.mlp_reduce is not None:
            m = self.mlp_reduce(m)
        return x + m, keep
