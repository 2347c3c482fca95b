"""Tiny GLM-5 checkpoints written by transformers' own save_pretrained (the reference nobody
here wrote)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=32,
    qk_nope_head_dim=16,
    # 16 indexer heads: with few heads many keys score exactly 0 (every relu off) and top-k ties
    # become likely; tie order is implementation-defined in torch.topk: keep ties improbable here.
    index_head_dim=32,
    index_n_heads=16,
    initializer_range=0.08,
    bos_token_id=0,
    eos_token_id=1,
)

YARN_GROUPED = dict(
    num_hidden_layers=4,
    first_k_dense_replace=2,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    indexer_types=["full", "full", "shared", "full"],
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

CONFIGS = {
    # 1 dense + 2 MoE, one group, default rope, index_topk below the prompt, a shared DSA layer
    "dense1_shared_topk16": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        index_topk=16,
        indexer_types=["full", "shared", "full"],
    ),
    # 2 dense + 2 MoE, grouped routing, yarn rope with mscale, index_topk below the prompt
    "dense2_grouped_yarn_topk40": dict(YARN_GROUPED, index_topk=40),
    # the same with index_topk above every prompt (DSA never selects): for config reading only,
    # the logit comparisons skip it (see selecting)
    "dense2_grouped_yarn_topk128": dict(YARN_GROUPED, index_topk=128),
    # all MoE, 2 groups keep 1, linear rope, a very small index_topk
    "moe_only_linear_topk8": dict(
        num_hidden_layers=2,
        first_k_dense_replace=0,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        index_topk=8,
        routed_scaling_factor=1.5,
        indexer_types=["full", "shared"],
        rope_parameters={"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0},
    ),
}


def selecting(min_prompt_len: int) -> list[str]:
    """The configs whose DSA selection is active for prompts of at least min_prompt_len tokens."""
    return sorted(n for n, c in CONFIGS.items() if c["index_topk"] < min_prompt_len)


def make_hf_model(name: str, seed: int = 0):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**{**BASE, **CONFIGS[name]})
    model = GlmMoeDsaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with (
        torch.no_grad()
    ):  # move norms, norm biases and the correction bias away from their initial values
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith("k_norm.bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn(b.shape, generator=g))
    return model


def save_hf_model(name: str, dst: Path, seed: int = 0):
    model = make_hf_model(name, seed)
    model.save_pretrained(dst)
    return model
