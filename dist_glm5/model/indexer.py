"""DSA lightning indexer: the projections that make each query's q and head weights and each
token's key. The scores and the selection over them are the backend's (`Ops.index_scores`,
`Ops.select_topk`; references and the tie rule in ops/indexer.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.linear import Linear
from dist_glm5.model.norm import LayerNorm
from dist_glm5.ops import Ops
from dist_glm5.ops.indexer import select_topk_reference  # noqa: F401  (named from here too)
from dist_glm5.ops.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops | None = None):
        super().__init__()
        self.apply_rope = ops.apply_rope if ops else apply_rope  # the backend's, or the reference
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.interleave = cfg.indexer_rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, False, ops)
        self.wk = Linear(cfg.hidden_size, self.head_dim, False, ops)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, False, ops)

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H], q_resid: [T, q_lora] -> q [T, Hi, D], k [T, D], head weights [T, Hi]
        (fp32)."""
        T = x.shape[0]
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        # The indexer ropes its FIRST rope_dim dims (MLA ropes its last ones).
        r = self.rope_dim
        rope = self.apply_rope
        q = torch.cat([rope(q[..., :r], cos, sin, self.interleave), q[..., r:]], dim=-1)
        k = torch.cat([rope(k[..., :r], cos, sin, self.interleave), k[..., r:]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return q, k, w
