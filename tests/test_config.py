"""ModelConfig.from_hf reads every glm_moe_dsa field and rejects invalid values by name."""

from __future__ import annotations

import pytest
from hf_tiny import BASE, CONFIGS

from dist_glm5.model.config import ModelConfig


def test_reads_transformers_config(tmp_path):
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(**{**BASE, **CONFIGS["dense2_grouped_yarn_topk128"]})
    hf.save_pretrained(tmp_path)
    c = ModelConfig.from_hf(tmp_path)
    assert c.indexer_types == ("full", "full", "shared", "full")
    assert c.mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    assert c.rope.type == "yarn" and c.rope.factor == 4.0 and c.rope.mscale_all_dim == 1.0
    assert c.n_group == 4 and c.topk_group == 2 and c.index_topk == 128
    assert c.qk_head_dim == 32 and c.kv_cache_dim == 48
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_real_glm5_shape_and_legacy_fields():
    c = ModelConfig.from_hf(
        {
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 78,
            "rope_theta": 1000000,
            "num_nextn_predict_layers": 1,
            "index_topk_pattern": "FFF" + "SF" * 37 + "S",
            "eos_token_id": [154820, 154827, 154829],
            "rope_interleave": True,
            "indexer_rope_interleave": True,
        }
    )
    assert c.rope.theta == 1e6 and c.num_mtp_layers == 1 and len(c.indexer_types) == 78
    assert c.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert c.kv_cache_dim * 2 == 1152  # MLA cache bytes per token per layer in bf16
    assert c.is_moe_layer(78) and c.has_indexer(78)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("n_group", 3, "n_group"),
        ("topk_group", 9, "topk_group"),
        ("num_experts_per_tok", 0, "num_experts_per_tok"),
        ("hidden_act", "gelu", "hidden_act"),
        ("indexer_types", ["full", "bogus", "full"], "indexer_types"),
        ("indexer_types", ["shared", "full", "full"], "layer 0 must be 'full'"),
        ("mlp_layer_types", ["dense"], "mlp_layer_types"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_type"),
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("qk_rope_head_dim", 15, "qk_rope_head_dim"),
        ("eos_token_id", 999, "eos_token_id"),
    ],
)
def test_invalid_values_name_the_field(field, value, needle):
    d = {**BASE, **CONFIGS["dense1_shared_topk16"], "model_type": "glm_moe_dsa", field: value}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(d)
    assert needle in str(e.value) and field.split("_parameters")[0] in str(e.value)


def test_wrong_model_type_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
