"""The MTP layer against an independent, straightforward implementation of its math.

The reference below shares no code with dist_glm5's MTP path: the block is transformers' own
GlmMoeDsaDecoderLayer (its MLA, DSA indexer and MoE), the target hidden comes from transformers'
model, and the MTP glue is written out here from the formula:
    row i (position i):  h' = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)]),
                             embed zeroed at position 0
                         logits_i = lm_head(shared_head.norm(block(h')))   (predicts t_{i+2})
with h_i the target model's hidden AFTER its final norm.
"""

from __future__ import annotations

import json

import pytest
import torch

from dist_glm5.checkpoint.safetensors_io import Checkpoint
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.model.reference_loop import mtp_one_shot
from dist_glm5.train.hf import hf_copy


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(scope="module")
def reference(default_model_dir, tmp_path_factory):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        GlmMoeDsaDecoderLayer,
        GlmMoeDsaRotaryEmbedding,
    )

    raw = json.loads((default_model_dir / "config.json").read_text())
    n = raw["num_hidden_layers"]
    ck = Checkpoint(default_model_dir)
    # transformers' main model (it does not run layer n)
    d = tmp_path_factory.mktemp("hf_main")
    ref = GlmMoeDsaForCausalLM.from_pretrained(hf_copy(default_model_dir, d)).eval()
    # transformers' decoder block built for layer index n, weights from the checkpoint's layer-n
    # tensors
    raw2 = dict(raw, num_hidden_layers=n + 1, indexer_types=raw["indexer_types"] + ["full"])
    raw2.pop("mlp_layer_types", None)
    cfg2 = GlmMoeDsaConfig(
        **{k: v for k, v in raw2.items() if k not in ("architectures", "model_type")}
    )
    cfg2._attn_implementation = (
        "eager"  # standalone modules default to None, which skips the DSA mask
    )
    cfg2._experts_implementation = "eager"
    block = GlmMoeDsaDecoderLayer(cfg2, n).eval()
    pre = f"model.layers.{n}."
    sd = {}
    E = raw["n_routed_experts"]
    for k, _v in block.state_dict().items():
        if k == "mlp.experts.gate_up_proj":
            sd[k] = torch.stack(
                [
                    torch.cat(
                        [
                            ck.get(f"{pre}mlp.experts.{e}.gate_proj.weight"),
                            ck.get(f"{pre}mlp.experts.{e}.up_proj.weight"),
                        ]
                    )
                    for e in range(E)
                ]
            )
        elif k == "mlp.experts.down_proj":
            sd[k] = torch.stack(
                [ck.get(f"{pre}mlp.experts.{e}.down_proj.weight") for e in range(E)]
            )
        else:
            sd[k] = ck.get(pre + k)
    block.load_state_dict(sd)
    rot = GlmMoeDsaRotaryEmbedding(cfg2)
    eps = raw["rms_norm_eps"]
    W = {
        k: ck.get(pre + k)
        for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    }

    @torch.no_grad()
    def mtp_logits(tokens: list[int]) -> torch.Tensor:
        """Rows 0..len-2 of the MTP over `tokens` (row i pairs h_i with t_{i+1})."""
        ids = torch.tensor(tokens)
        h = ref.model(ids[None]).last_hidden_state[0]  # post final norm
        L = len(tokens) - 1
        emb = ref.model.embed_tokens(ids[1:])
        emb[0] = 0.0  # position 0
        x = (
            torch.cat([_rms(emb, W["enorm.weight"], eps), _rms(h[:L], W["hnorm.weight"], eps)], -1)
            @ W["eh_proj.weight"].T
        )
        pos = torch.arange(L)[None]
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        out, _ = block(
            x[None], attention_mask=mask, position_ids=pos, position_embeddings=rot(x[None], pos)
        )
        return ref.lm_head(_rms(out[0], W["shared_head.norm.weight"], eps))

    return mtp_logits


def test_mtp_matches_independent_reference(default_model, reference):
    tokens = torch.randint(
        0, 256, (90,), generator=torch.Generator().manual_seed(3)
    ).tolist()  # > index_topk
    want = reference(tokens)
    got = mtp_one_shot(default_model, tokens)
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"MTP logits differ by {err:.2e}"


def test_mtp_incremental_equals_one_shot(default_model):
    m = default_model
    tokens = torch.randint(0, 256, (81,), generator=torch.Generator().manual_seed(4)).tolist()
    full = mtp_one_shot(m, tokens)
    cache = m.new_cache(16, 16)
    got = []
    with torch.no_grad():
        spans = [(0, 66)] + [(p, p + 1) for p in range(66, 80)]
        for a, b_ in spans:  # main then MTP at the same positions, step by step as decode runs them
            b = cache.prepare([Chunk(0, a, b_ - a)])
            h, _ = m(torch.tensor(tokens[a:b_]), b, cache)
            got.append(
                m.mtp_logits(
                    m.mtp_forward(torch.tensor(tokens[a + 1 : b_ + 1]), m.final_norm(h), b, cache)
                )
            )
    torch.testing.assert_close(torch.cat(got), full, rtol=0, atol=1e-4)
