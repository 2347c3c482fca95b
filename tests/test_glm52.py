"""convert glm52: AMD Quark MXFP4 exports repacked byte for byte.

Two sources: one made here in Quark's export format (names, dtypes, quantization_config) with our
quark-rule encoder, which runs everywhere; and a real export by amd-quark 0.13 (ModelQuantizer +
export_safetensors), where amd-quark is installed. Both get a GLM-5.2-style MTP layer shipped in
BF16, which glm52 must encode with --mtp-rule.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import require
from hf_tiny import make_hf_model
from mxfp4_ref import decode_independent

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.default_model import random_weights
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.checkpoint.safetensors_io import Checkpoint, CheckpointError, save_streaming
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.model.reference_loop import full_logits
from dist_glm5.quant.mxfp4 import encode

QUANTISED = re.compile(r"\.mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight$")
QUARK_QCFG = {
    "quant_method": "quark",
    "version": "0.13",
    "export": {"weight_format": "real_quantized", "pack_method": "reorder"},
    "global_quant_config": {
        "weight": {
            "dtype": "fp4",
            "group_size": 32,
            "scale_format": "e8m0",
            "qscheme": "per_group",
            "scale_calculation_mode": "even",
            "round_method": "half_even",
        }
    },
    "exclude": ["*self_attn*", "*mlp.gate", "*lm_head"],
}


def _add_mtp_bf16(d):
    """Append a BF16 MTP layer (as the GLM-5.2 release ships it) and say so in config.json."""
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    n = cfg["num_hidden_layers"]
    mtp = {
        k: v.to(torch.bfloat16)
        for k, v in random_weights(ModelConfig.from_hf(replace_q(cfg)), 1).items()
        if k.startswith(f"model.layers.{n}.")
    }
    save_streaming(d / "model-mtp.safetensors", mtp)
    (d / "model.safetensors.index.json").unlink(missing_ok=True)


def replace_q(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


def _quark_format_export(d):
    """A Quark-format export made with our quark-rule encoder (byte-identical to amd-quark's,
    tested elsewhere)."""
    model = make_hf_model("dense1_shared_topk16", seed=5).to(torch.bfloat16)
    model.save_pretrained(d)
    ck = Checkpoint(d)
    out = {}
    for n in ck.names():
        t = ck.get(n).clone()
        if QUANTISED.search(n):
            out[n], out[n[: -len(".weight")] + ".weight_scale"] = encode(t, "quark")
        else:
            out[n] = t
    (d / "model.safetensors").unlink()
    save_streaming(d / "model.safetensors", out)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = QUARK_QCFG
    (d / "config.json").write_text(json.dumps(cfg))


def _real_quark_export(d):
    require("quark.torch")
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    model = make_hf_model("dense1_shared_topk16", seed=6).to(torch.bfloat16)
    preprocess_for_quantization(model)
    model = ModelQuantizer(
        LLMTemplate.get("glm_moe_dsa").get_config(scheme="mxfp4_weight_only")
    ).quantize_model(model, None)
    export_safetensors(model, d)


@pytest.fixture(scope="module", params=["quark-format", "amd-quark"])
def quark_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    (_quark_format_export if request.param == "quark-format" else _real_quark_export)(d)
    _add_mtp_bf16(d)
    return d


@pytest.fixture(scope="module")
def repacked(quark_dir, tmp_path_factory):
    from dist_glm5.convert.glm52 import convert_glm52

    out = tmp_path_factory.mktemp("repacked") / "out"
    convert_glm52(quark_dir, out, mtp_rule="ocp")
    return out


def test_repacked_bytes_are_the_source_bytes(quark_dir, repacked):
    src, out = Checkpoint(quark_dir), Checkpoint(repacked)
    cfg = json.loads((quark_dir / "config.json").read_text())
    E, n = cfg["n_routed_experts"], cfg["num_hidden_layers"]
    for layer in (1, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        for t, projs in (("w13_weight", ("gate_proj", "up_proj")), ("w2_weight", ("down_proj",))):
            for kind, suffix in ((t, "weight"), (t + "_scale", "weight_scale")):
                fused = out.get(f"{pre}.routed_experts.{kind}")
                want = torch.stack(
                    [
                        torch.cat([src.get(f"{pre}.{e}.{p}.{suffix}") for p in projs])
                        for e in range(E)
                    ]
                )
                assert torch.equal(fused, want), (layer, kind)
    # shared experts become bf16, exactly the decoded MXFP4 values (decoded through ml_dtypes)
    sh = "model.layers.1.mlp.shared_experts.up_proj"
    want = decode_independent(
        src.get(f"{sh}.weight"), src.get(f"{sh}.weight_scale"), torch.bfloat16
    )
    assert torch.equal(out.get(f"{sh}.weight"), want)
    # the BF16 MTP experts are encoded with the OCP rule
    pre = f"model.layers.{n}.mlp.experts"
    g, s = encode(src.get(f"{pre}.3.gate_proj.weight"), "ocp")
    I = cfg["moe_intermediate_size"]
    assert torch.equal(out.get(f"{pre}.routed_experts.w13_weight")[3, :I], g)
    assert torch.equal(out.get(f"{pre}.routed_experts.w13_weight_scale")[3, :I], s)
    q = json.loads((repacked / "config.json").read_text())["quantization_config"]
    assert q["rule"] == "quark" and q["mtp_rule"] == "ocp" and q["encoded_with_mtp_rule"] == [pre]


def _dequantised_float_copy(quark_dir, repacked, dst):
    """The Quark checkpoint dequantised directly (every MXFP4 pair decoded by ml_dtypes, not by
    dist_glm5.quant.mxfp4), MTP experts as served."""
    dst.mkdir()
    cfg = json.loads((quark_dir / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(replace_q(cfg)))
    src, out = Checkpoint(quark_dir), Checkpoint(repacked)
    t = {}
    for n in src.names():
        if n.endswith(".weight_scale"):
            continue
        w = src.get(n)
        if w.dtype == torch.uint8:
            scale = src.get(n[: -len(".weight")] + ".weight_scale")
            w = decode_independent(w, scale, torch.bfloat16)
        t[n] = w
    # the MTP experts: what glm52 served (BF16 encoded with ocp), decoded, so both sides hold the
    # same values
    pre = f"model.layers.{cfg['num_hidden_layers']}.mlp.experts"
    I = cfg["moe_intermediate_size"]
    w13, w2 = (
        decode_independent(
            out.get(f"{pre}.routed_experts.{w}"),
            out.get(f"{pre}.routed_experts.{w}_scale"),
            torch.bfloat16,
        )
        for w in ("w13_weight", "w2_weight")
    )
    for e in range(cfg["n_routed_experts"]):
        t[f"{pre}.{e}.gate_proj.weight"], t[f"{pre}.{e}.up_proj.weight"] = (
            w13[e, :I].clone(),
            w13[e, I:].clone(),
        )
        t[f"{pre}.{e}.down_proj.weight"] = w2[e].clone()
    save_streaming(dst / "model.safetensors", t)
    return dst


def test_repacked_logits_equal_dequantised_quark(quark_dir, repacked, tmp_path):
    ref = load_model(
        _dequantised_float_copy(quark_dir, repacked, tmp_path / "deq"),
        dtype=torch.float32,
        ops=get_backend("cpu").ops(),
    )
    ours = load_model(repacked, dtype=torch.float32, ops=get_backend("cpu").ops())
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(full_logits(ours, ids), full_logits(ref, ids), rtol=0, atol=1e-5)
    outs = []
    for m in (ours, ref):  # and the MTP layer
        cache = m.new_cache(8, 16)
        with torch.no_grad():
            b = cache.prepare([Chunk(0, 0, 39)])
            h, _ = m(torch.tensor(ids[:39]), b, cache)
            outs.append(
                m.mtp_logits(m.mtp_forward(torch.tensor(ids[1:]), m.final_norm(h), b, cache))
            )
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


def test_glm52_refuses_non_quark_and_broken_pairs(quark_dir, tmp_path):
    from dist_glm5.convert.glm52 import convert_glm52

    with pytest.raises(ValueError, match="convert glm53"):
        convert_glm52(_bf16_copy(tmp_path), tmp_path / "o1")
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text((quark_dir / "config.json").read_text())
    ck = Checkpoint(quark_dir)
    t = {
        n: ck.get(n).clone()
        for n in ck.names()
        if n != "model.layers.2.mlp.experts.1.up_proj.weight_scale"
    }
    save_streaming(d / "model.safetensors", t)
    with pytest.raises(
        CheckpointError, match=r"experts\.1\.up_proj\.weight is uint8 but has no \.weight_scale"
    ):
        convert_glm52(d, tmp_path / "o2")


def _bf16_copy(tmp_path):
    d = tmp_path / "bf16"
    make_hf_model("dense1_shared_topk16", seed=5).to(torch.bfloat16).save_pretrained(d)
    return d
