"""Byte identity of dist_glm5.quant.mxfp4 with the real encoders it reproduces.

- rule "quark" vs AMD Quark (PyPI `amd-quark`, 0.13): the exact code path of Quark's weight-only
  MXFP4 export. A weight FakeQuantize built from `OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False)`
  (the `mxfp4_weight_only` scheme) observes the weight (PerBlockMXObserver -> even_round), then
  `StaticScaledRealQuantizer.to_real_quantize_params` (scaled_real_quantize "fp4" -> the C++
  `fake_quantize_to_low_precision_fp` -> `Pack_fp4.pack`) gives `weight` uint8 [out, in/2] and
  `maybe_convert_and_transpose_scale` (`to_e8m0_uint8`) gives `weight_scale` uint8 [out, in/32],
  as `ExportBuilder._real_quantize` does on export. One test also runs the whole thing on a tiny
  GlmMoeDsaForCausalLM: preprocess_for_quantization, ModelQuantizer, export_safetensors.
- rule "ocp" vs torchao (`torchao.prototype.mx_formats.mx_tensor.to_mx`, FLOOR scale mode).

The oracles come with the `oracles` extra: pip install -e ".[cpu,test,oracles]". Where one cannot
be imported its tests skip, except in CI (CI=true), where they fail (conftest.require).
`import quark.torch` takes ~20 s and compiles a small C++ op with g++ on first use.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import pytest
import torch
from conftest import require

from dist_glm5.quant.mxfp4 import decode, encode

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def quark_encode():
    require("quark.torch")
    from dist_glm5.bench.oracles import quark_encoder

    return quark_encoder()


@pytest.fixture(scope="module")
def torchao_encode():
    require("torchao.prototype.mx_formats.mx_tensor")
    from dist_glm5.bench.oracles import torchao_encoder

    return torchao_encoder()


def _oracle_for(rule, request):
    return request.getfixturevalue("quark_encode" if rule == "quark" else "torchao_encode")


def _assert_same(rule, w, oracle_fn):
    ours_p, ours_s = encode(w, rule)
    ref_p, ref_s = oracle_fn(w)
    assert ref_p.dtype == torch.uint8 and ref_s.dtype == torch.uint8
    assert ref_p.shape == ours_p.shape and ref_s.shape == ours_s.shape
    bad_s = (ours_s != ref_s).nonzero()
    assert bad_s.numel() == 0, (
        f"{rule}: scale bytes differ at {bad_s[:5].tolist()}: ours "
        f"{ours_s[tuple(bad_s[:5].t())].tolist()} oracle {ref_s[tuple(bad_s[:5].t())].tolist()}"
    )
    bad_p = (ours_p != ref_p).nonzero()
    assert bad_p.numel() == 0, (
        f"{rule}: packed bytes differ at {bad_p[:5].tolist()}: ours "
        f"{ours_p[tuple(bad_p[:5].t())].tolist()} oracle {ref_p[tuple(bad_p[:5].t())].tolist()}"
    )


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Random tensors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["quark", "ocp"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_random_normal_tensors(rule, dtype, request):
    oracle_fn = _oracle_for(rule, request)
    g = torch.Generator().manual_seed(10)
    scales = [1e-30, 1e-3, 0.02, 1.0, 50.0, 1e30] if dtype != "fp16" else [1e-3, 0.02, 1.0, 50.0]
    for s in scales:
        w = (torch.randn(96, 384, generator=g) * s).to(DTYPES[dtype])
        _assert_same(rule, w, oracle_fn)
    # heavy tails and per-row magnitudes spanning the whole exponent range
    w = torch.distributions.StudentT(2.0).sample((64, 512)) * torch.logspace(-36, 36, 64)[:, None]
    _assert_same(
        rule,
        w.to(DTYPES[dtype]) if dtype != "fp16" else (w / w.abs().amax() * 1e4).half(),
        oracle_fn,
    )


# ---------------------------------------------------------------------------------------------
# Crafted blocks
# ---------------------------------------------------------------------------------------------


def _crafted_rows(allow_nonfinite: bool) -> np.ndarray:
    """Rows of 64 fp32 values (two blocks each), one edge case per row."""
    f32 = np.float32
    rng = np.random.default_rng(11)
    rows = []

    def row(vals):
        r = np.zeros(64, dtype=np.float32)
        if isinstance(vals, np.ndarray):  # fp32 bit patterns, kept exactly (NaN payloads)
            r[: len(vals)] = vals
        else:
            with np.errstate(over="ignore"):
                r[: len(vals)] = np.array(vals, dtype=np.float64).astype(np.float32)
        rows.append(r)

    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for k in [-126, -125, -124, -120, -60, -10, -1, 0, 1, 10, 60, 120, 125, 126]:
        s = 2.0**k
        seven = f32(7 * s) if 7 * s < 3.4e38 else f32(3.4e38)
        below = np.nextafter(seven, f32(0))
        row(
            [seven] + [m * s / 2 for m in mids] + [-m * s / 2 for m in mids]
        )  # ties at X = k - 1 + 2
        row([below] + [m * s / 2 * 1.0000001 for m in mids] + [-(m * s / 2) for m in mids])
        row([-seven, 6 * s, 4 * s, -3.5 * s, 0.3 * s, -0.2 * s, -0.1 * s])
        row([f32(1.75 * s), f32(1.5 * s) * 1.0000001, -f32(1.7499999 * s)])
        row([4 * s, -0.0625 * s, -0.125 * s, -0.24 * s, -0.25 * s, -0.26 * s, 0.25 * s, -0.0])
        row((rng.standard_normal(64) * s).tolist())
    row([0.0])  # all zero
    row([-0.0] * 64)
    row([-0.0, 1.0, -0.0])
    for v in [
        2.0**-130,
        1e-40,
        2.0**-149,
        2.0**-127 * 1.5,
        2.0**-126,
        2.0**-125 * 1.75,
        2.0**-124 * 1.74,
        1.17e-38,
        3e38,
        1.7e38,
        3.4028234663852886e38,
        1.75 * 2.0**127,
    ]:
        row([v, -v / 2, v / 3, -v / 5, v / 7, v / 64, -v / 1000])
        row([-v] + (rng.standard_normal(63) * v / 8).tolist())
    row((rng.standard_normal(64) * 2.0**-128).tolist())  # subnormal-only blocks
    if allow_nonfinite:
        inf, nan = math.inf, math.nan
        row([inf, 1.0, -inf, 3e38, -1e-3, 0.0, -0.0])
        row([-inf, 5.0, -2.0])
        row([nan, 1.0, -1.0, 0.0, -0.0, 2.0**-130])
        row([nan, inf, -inf, 1.0])
        nans = np.array(
            [
                0xFFC00000,
                0x7FFFFFFF,
                0xFFFF0000,
                0x7F800001,
                0x7FE00000,
                0x3F800000,
                0xC0400000,
                0x7F800000,
            ],
            dtype=np.uint32,
        ).view(np.float32)  # NaN payloads, then 1, -3, inf
        row(nans)
    return np.stack(rows)


@pytest.mark.parametrize("rule", ["quark", "ocp"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_crafted_edge_blocks(rule, dtype, request):
    oracle_fn = _oracle_for(rule, request)
    w = torch.from_numpy(_crafted_rows(allow_nonfinite=False))
    if dtype == "fp16":
        w = w.clamp(-60000, 60000)
    _assert_same(rule, w.to(DTYPES[dtype]), oracle_fn)


@pytest.mark.parametrize("rule", ["quark", "ocp"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_inf_and_nan_blocks(rule, dtype, request):
    """Not meaningful weights; the codec must match the oracle's defined output byte for byte."""
    oracle_fn = _oracle_for(rule, request)
    w = torch.from_numpy(_crafted_rows(allow_nonfinite=True)[-5:].copy())
    _assert_same(rule, w.to(DTYPES[dtype]), oracle_fn)


@pytest.mark.parametrize("rule", ["quark", "ocp"])
def test_every_bf16_pattern(rule, request):
    """Every bf16 bit pattern, each as the amax of its own block and beside a 0.3x neighbour."""
    oracle_fn = _oracle_for(rule, request)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    w = torch.zeros(65536, 32, dtype=torch.bfloat16)
    w[:, 0] = bits.view(torch.bfloat16)
    w[:, 1] = (bits.view(torch.bfloat16).float() * -0.3).to(torch.bfloat16)
    w[:, 2] = (bits.view(torch.bfloat16).float() * 0.77).to(torch.bfloat16)
    _assert_same(rule, w, oracle_fn)


def test_decode_matches_quark_dequantize(quark_encode):
    """Quark's own unpack + dequantize of its bytes equals our decode."""
    from quark.torch.utils.pack import Pack_fp4

    w = torch.randn(32, 256) * 0.1
    packed, scales = quark_encode(w)
    values = Pack_fp4("per_group", "fp4").unpack(
        packed, reorder=True
    )  # [32, 256] fp32 codes' values
    scale = 2.0 ** (scales.to(torch.int32) - 127).float()
    theirs = values * scale.repeat_interleave(32, dim=-1)
    assert torch.equal(decode(packed, scales, torch.float32), theirs)


# ---------------------------------------------------------------------------------------------
# Whole model through Quark's quantize + export
# ---------------------------------------------------------------------------------------------


def test_whole_tiny_glm_moe_dsa_export(quark_encode, tmp_path):
    """Quantise a tiny GlmMoeDsaForCausalLM with Quark's mxfp4_weight_only template, export it,
    and compare every expert's exported weight/weight_scale with our encode of the bf16 weight."""
    transformers = require("transformers")
    import safetensors.torch as safetensors_torch  # a core dependency
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(12)
    model = transformers.GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16).eval()
    inter = cfg.moe_intermediate_size
    # Make the expert weights interesting: per-expert magnitudes from 1e-6 to 1e3, exact ties,
    # all-zero blocks, negatives that round to zero, tiny blocks.
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            experts = layer.mlp.experts
            for p in (experts.gate_up_proj, experts.down_proj):
                for e in range(p.shape[0]):
                    p[e] = torch.randn(p.shape[1:]) * 10.0 ** (3 * e - 6)
                p[0, 0, :32] = 0
                p[1, 1, :8] = torch.tensor([7.0, 3.5, -1.75, 0.25, -0.2, -0.25, 5.0, -0.0])
                p[2, 2, :] = 2.0**-128
                p[3, 3, :4] = torch.tensor([2.0**-126, -(2.0**-127), 1.0, -0.5])
    original = {k: v.clone() for k, v in model.state_dict().items()}

    t0 = time.perf_counter()
    preprocess_for_quantization(
        model
    )  # fused experts -> per-expert nn.Linear, else they stay float
    config = LLMTemplate.get("glm_moe_dsa").get_config(scheme="mxfp4_weight_only")
    model = ModelQuantizer(config).quantize_model(model, None)
    export_safetensors(model, tmp_path)
    logger.info("quark quantize + export of the tiny model: %.1f s", time.perf_counter() - t0)

    exported = {}
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            exported.update(safetensors_torch.load_file(str(tmp_path / name)))
    assert (
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"]
        == "quark"
    )

    compared = 0
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp"
        gate_up = original[f"{pre}.experts.gate_up_proj"]  # [E, 2I, H], rows [gate; up]
        down = original[f"{pre}.experts.down_proj"]  # [E, H, I]
        tensors = {}
        for e in range(cfg.n_routed_experts):
            tensors[f"experts.{e}.gate_proj"] = gate_up[e, :inter]
            tensors[f"experts.{e}.up_proj"] = gate_up[e, inter:]
            tensors[f"experts.{e}.down_proj"] = down[e]
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"shared_experts.{name}"] = original[f"{pre}.shared_experts.{name}.weight"]
        for name, w in tensors.items():
            weight, scale = exported[f"{pre}.{name}.weight"], exported[f"{pre}.{name}.weight_scale"]
            assert weight.dtype == torch.uint8 and weight.shape == (w.shape[0], w.shape[1] // 2), (
                name
            )
            assert scale.dtype == torch.uint8 and scale.shape == (w.shape[0], w.shape[1] // 32), (
                name
            )
            ours_p, ours_s = encode(w, "quark")
            assert torch.equal(ours_s, scale), name
            assert torch.equal(ours_p, weight), name
            compared += 1
    assert compared == (cfg.num_hidden_layers - cfg.first_k_dense_replace) * (
        3 * cfg.n_routed_experts + 3
    )
