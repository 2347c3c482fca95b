"""RoPE against transformers' own glm_moe_dsa rotary embedding; host tables grow and slice.

The reference side is entirely transformers': GlmMoeDsaRotaryEmbedding (ROPE_INIT_FUNCTIONS for
linear and yarn, its attention_scaling on cos/sin), apply_rotary_pos_emb_interleave (GLM) or
DeepSeek-V3.2's half-split apply_rotary_pos_emb, and GlmMoeDsaAttention.scaling (yarn's mscale
squared on the softmax scale). Ours: ModelConfig.from_hf -> RopeTable.lookup -> apply_rope, and
cfg.softmax_scale. Rotated q/k and the rope part of the attention scores must agree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import require

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.rope import MAX_POSITIONS, RopeTable
from dist_glm5.ops.rope import apply_rope

DIM = 16  # qk_rope_head_dim
HEADS = 3

# name -> (rope_parameters, max_position_embeddings)
ROPES = {
    "default": ({"rope_type": "default", "rope_theta": 1e6}, 262144),
    "linear": ({"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}, 262144),
    # GLM-5 / DeepSeek-V3 style: mscale == mscale_all_dim, so cos/sin are unscaled and the
    # softmax scale gets mscale**2
    "yarn mscale=mscale_all_dim": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        128,
    ),
    # both scalings non-trivial: cos/sin by get_mscale(f, 0.707) / get_mscale(f, 1), softmax by
    # get_mscale(f, 1)**2
    "yarn mscale 0.707": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        163840,
    ),
    # no mscale fields: cos/sin by 0.1 ln(factor) + 1, the softmax scale untouched; no truncation
    "yarn plain untruncated": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
        512,
    ),
    # an explicit attention_factor wins for cos/sin; mscale_all_dim still scales the softmax
    "yarn attention_factor": (
        {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 0.8,
            "mscale_all_dim": 0.5,
        },
        512,
    ),
}


def _positions(max_pos: int) -> torch.Tensor:
    pos = {0, 1, 2, 7, 31, 32, 33, 100, 1000, 4095, 65535, 150000, max_pos - 1}
    return torch.tensor(sorted(p for p in pos if p < max_pos))


def _hf(rope_parameters: dict, max_pos: int):
    GlmMoeDsaConfig = require("transformers").GlmMoeDsaConfig
    return GlmMoeDsaConfig(
        vocab_size=64,
        hidden_size=64,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=DIM,
        v_head_dim=16,
        index_head_dim=32,
        index_n_heads=2,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
    )


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("name", list(ROPES))
def test_rotation_and_scores_match_transformers(name, interleave):
    require("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_mod

    rope_parameters, max_pos = ROPES[name]
    hf_cfg = _hf(rope_parameters, max_pos)
    ours_cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "rope_interleave": interleave})
    assert ours_cfg.rope.type == rope_parameters["rope_type"]
    assert ours_cfg.rope_interleave is interleave

    pos = _positions(max_pos)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, len(pos), DIM, generator=g)  # [B, heads, T, D]
    k = torch.randn(1, 1, len(pos), DIM, generator=g)  # MLA's single shared rope key

    # transformers: cos/sin from the model's rotary module, scale from the model's attention module
    rotary = hf_mod.GlmMoeDsaRotaryEmbedding(hf_cfg)
    cos, sin = rotary(q, pos[None])
    fn = hf_mod.apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    q_hf, k_hf = fn(q, k, cos, sin)
    scaling_hf = hf_mod.GlmMoeDsaAttention(hf_cfg, 0).scaling
    scores_hf = (q_hf @ k_hf.transpose(-1, -2))[0] * scaling_hf  # [heads, T, T]

    # ours: the table Glm5Model builds, the same apply_rope for q and k, cfg.softmax_scale
    table = RopeTable(ours_cfg.rope, ours_cfg.qk_rope_head_dim, ours_cfg.max_position_embeddings)
    c, s = table.lookup(pos)
    q_ours = apply_rope(q[0].transpose(0, 1), c, s, ours_cfg.rope_interleave)  # [T, heads, D]
    k_ours = apply_rope(k[0].transpose(0, 1), c, s, ours_cfg.rope_interleave)[:, 0]  # [T, D]
    scores = torch.einsum("thd,sd->hts", q_ours, k_ours) * ours_cfg.softmax_scale

    torch.testing.assert_close(q_ours.transpose(0, 1), q_hf[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0, 0], rtol=1e-5, atol=1e-5)
    assert ours_cfg.softmax_scale == pytest.approx(scaling_hf, rel=1e-12)
    torch.testing.assert_close(scores, scores_hf, rtol=1e-5, atol=1e-5)


def test_the_cases_exercise_both_scalings():
    """Guard the parameter table: yarn must scale cos/sin and the softmax, alone and together."""
    require("transformers")
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_mod

    seen = {}
    for name, (rp, max_pos) in ROPES.items():
        cfg = _hf(rp, max_pos)
        cos_scale = hf_mod.GlmMoeDsaRotaryEmbedding(cfg).attention_scaling
        softmax = hf_mod.GlmMoeDsaAttention(cfg, 0).scaling * (32**0.5)  # qk_head_dim 32
        seen[name] = (abs(cos_scale - 1) > 1e-3, abs(softmax - 1) > 1e-3)
    assert seen["default"] == seen["linear"] == (False, False)
    assert seen["yarn mscale=mscale_all_dim"] == (False, True)
    assert seen["yarn mscale 0.707"] == (True, True)
    assert seen["yarn plain untruncated"] == (True, False)
    assert seen["yarn attention_factor"] == (True, True)


def test_table_grows_on_demand_and_caps():
    from dist_glm5.model.config import RopeConfig

    t = RopeTable(RopeConfig(), 8, 1 << 20, initial=16)
    assert t.cos.shape[0] == 16
    c, _ = t.lookup(torch.tensor([100_000]))
    assert t.cos.shape[0] >= 100_001
    torch.testing.assert_close(c[0], torch.cos(100_000 * t.inv_freq))
    t.lookup(torch.tensor([MAX_POSITIONS - 1]))
    with pytest.raises(ValueError, match="RoPE table limit"):
        t.lookup(torch.tensor([MAX_POSITIONS]))
