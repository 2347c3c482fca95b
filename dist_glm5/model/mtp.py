"""The multi-token-prediction (MTP) layer, stored as layer `num_hidden_layers` (78 in GLM-5).

Math (DeepSeek-V3 style, as vLLM's deepseek_mtp.py and SGLang's deepseek_nextn.py run it):
    h' = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])   # embedding FIRST, then hidden
    h'' = decoder_block(h')  at position i                 # a full MoE block with its own DSA
                                                           # indexer
    logits = lm_head(shared_head.norm(h''))                # predicts t_{i+2}
Which h: the target model's last hidden state AFTER its final norm. Both engines feed that:
vLLM's DeepseekV2Model.forward returns norm(hidden, residual) and the v1 model runner passes it to
the drafter as target_hidden_states; SGLang captures the same post-norm tensor in its logits
processor. Position 0 (row paired with h_0): the embedding is zeroed, as vLLM does ("not needed by
MTP"); SGLang does not, and it only affects the first prompt row. GLM-5 ships no shared_head.head or
embed_tokens in layer 78: the main model's are shared (vLLM PR #34385 fixed 0% acceptance from
not sharing the head); if a checkpoint does carry them, they are used.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.kv_cache import ForwardBatch, PagedKVCache
from dist_glm5.model.layer import DecoderLayer
from dist_glm5.model.linear import Linear
from dist_glm5.model.norm import RMSNorm
from dist_glm5.ops import Ops


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.head: nn.Linear | None = None  # set by the loader only if the checkpoint has its own


class MTPLayer(DecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        ops: Ops,
        experts: range | None = None,
        dsa: DSAConfig | None = None,
    ):
        super().__init__(cfg, layer, ops, experts, dsa)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, False, ops)
        self.shared_head = SharedHead(cfg, ops)
        self.embed_tokens: nn.Embedding | None = None  # likewise optional

    def forward_mtp(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """emb: [T, H] embeddings of the NEXT tokens, hidden: [T, H] post-norm target hidden
        -> [T, H] normed."""
        emb = emb.masked_fill((batch.positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        x, _ = self.forward(x, batch, cache, cos, sin, None)
        return self.shared_head.norm(x)
