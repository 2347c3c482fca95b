"""RoPE: both layouts against transformers' own functions; host tables grow and slice."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.model.config import RopeConfig
from dist_glm5.model.rope import MAX_POSITIONS, RopeTable, apply_rope


def _cos_sin_hf(table: RopeTable, pos: torch.Tensor):
    freqs = pos[:, None].float() * table.inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * table.scale)[None], (emb.sin() * table.scale)[None]


@pytest.mark.parametrize("interleave", [True, False])
def test_layouts_match_transformers(interleave):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t = RopeTable(RopeConfig(theta=1e6), 16, 4096)
    pos = torch.tensor([0, 1, 7, 1000, 4095])
    q = torch.randn(1, 3, 5, 16, generator=torch.Generator().manual_seed(0))  # [B, heads, T, D]
    cos, sin = _cos_sin_hf(t, pos)
    fn = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    want, _ = fn(q, q, cos, sin)
    c, s = t.lookup(pos)
    got = apply_rope(q[0].transpose(0, 1), c, s, interleave).transpose(0, 1)[None]  # ours: [T, heads, D]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_table_grows_on_demand_and_caps():
    t = RopeTable(RopeConfig(), 8, 1 << 20, initial=16)
    assert t.cos.shape[0] == 16
    c, _ = t.lookup(torch.tensor([100_000]))
    assert t.cos.shape[0] >= 100_001
    torch.testing.assert_close(c[0], torch.cos(100_000 * t.inv_freq))
    t.lookup(torch.tensor([MAX_POSITIONS - 1]))
    with pytest.raises(ValueError, match="RoPE table limit"):
        t.lookup(torch.tensor([MAX_POSITIONS]))
