"""Roofline of a decode step: the bytes each card must read from HBM per step, and the lower bound
on step time that bandwidth sets. COMPUTED from the config and a hardware description, never
measured.

Per MoE layer a card reads its share of the attention and shared-expert weights, and the routed
experts that the step's tokens activate on its EP rank (expected distinct experts of B tokens x k
routes among E experts, uniform routing); per layer and sequence it reads the indexer keys of the
whole context (DSA scans every key; a stage's ranks split the sequences' query rows) and the top-k
MLA rows the indexer selected.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dist_glm5.model.config import ModelConfig
from dist_glm5.planning.partition import partition_layers

GB = 10**9


@dataclass(frozen=True)
class HBM:
    name: str = "gaudi2"
    bandwidth: float = 2.45e12  # bytes/s per card
    cards_per_node: int = 8


@dataclass(frozen=True)
class StepBytes:
    stage: int
    attention_weights: float
    expert_weights: float
    dense_and_shared_weights: float
    indexer_keys: float
    mla_rows: float
    head: float

    @property
    def total(self) -> float:
        return sum(v for k, v in asdict(self).items() if k != "stage")


def decode_bytes(
    cfg: ModelConfig,
    nodes: int,
    context: int,
    batch: int,
    tokens_per_seq: int = 1,
    hw: HBM = HBM(),
    expert_bytes: float = 0.53125,
    weight_bytes: int = 2,
    idx_bytes: int = 132,
    mla_bytes: int = 1152,
) -> list[StepBytes]:
    R = hw.cards_per_node
    H, I, E, k = (
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
    )
    h = cfg.num_attention_heads
    attn = (
        H * cfg.q_lora_rank
        + H * cfg.kv_cache_dim
        + cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank
        + H * cfg.index_head_dim
        + H * cfg.index_n_heads
    ) + (
        cfg.q_lora_rank * h * cfg.qk_head_dim
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + h * cfg.v_head_dim * H
    ) / R
    tokens = batch * tokens_per_seq
    active = E * (1 - (1 - k / E) ** tokens)  # expected distinct experts hit by the step's tokens
    out = []
    for s, layers in enumerate(partition_layers(cfg, nodes)):
        own = list(layers) + (
            [cfg.num_hidden_layers] if s == nodes - 1 and cfg.num_nextn_predict_layers else []
        )
        moe = sum(cfg.is_moe_layer(i) for i in own)
        dense = len(own) - moe
        full = sum(cfg.has_indexer(i) for i in own)
        out.append(
            StepBytes(
                s,
                attention_weights=len(own) * attn * weight_bytes,
                expert_weights=moe * active / R * 3 * H * I * expert_bytes,
                dense_and_shared_weights=(
                    dense * 3 * H * cfg.intermediate_size + moe * 3 * H * I * cfg.n_shared_experts
                )
                / R
                * weight_bytes,
                indexer_keys=full
                * -(-batch // R)
                * context
                * idx_bytes,  # query rows are split over the ranks
                mla_rows=len(own) * tokens * min(cfg.index_topk, context) * mla_bytes,
                head=(cfg.vocab_size * H / R * weight_bytes) if s == nodes - 1 else 0.0,
            )
        )
    return out
