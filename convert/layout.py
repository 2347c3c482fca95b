"""The serving layout shared by the converters: which output file holds what, and the fused MXFP4
names.

Routed experts of a MoE layer (and of the MTP layer) are stored fused and stacked (vLLM's fused-MoE
layout): `model.layers.N.mlp.experts.routed_experts.`
    w13_weight        uint8 [E, 2I, H/2]   per expert its gate rows then its up rows ([gate; up],
                                           not interleaved)
    w13_weight_scale  uint8 [E, 2I, H/32]
    w2_weight         uint8 [E, H, I/2]
    w2_weight_scale   uint8 [E, H, I/32]
Everything else keeps its HF name. Output files: one per decoder layer
(`model-layer-NNNNN.safetensors`) and one for the embedding, final norm and lm_head
(`model-embed-head.safetensors`), so a crash costs at most one layer and a pipeline stage reads only
its layers' files.
"""

from __future__ import annotations

import re
from collections import defaultdict

from dist_glm5.model.config import SERVING_QUANT_METHOD, ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(
    r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\."
    r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$"
)
FUSED = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
HEAD_FILE = "model-embed-head.safetensors"


def layer_file(i: int) -> str:
    return f"model-layer-{i:05d}.safetensors"


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def file_of(name: str) -> str:
    i = layer_of(name)
    return HEAD_FILE if i is None else layer_file(i)


def expert_key(name: str):
    """(prefix, layer, expert, proj, kind) for a per-expert tensor name, else None."""
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)) if m else None


def fused_names(prefix: str) -> list[str]:
    return [f"{prefix}.routed_experts.{t}" for t in FUSED]


def fused_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return {
        "w13_weight": (E, 2 * I, H // 2),
        "w13_weight_scale": (E, 2 * I, H // 32),
        "w2_weight": (E, H, I // 2),
        "w2_weight_scale": (E, H, I // 32),
    }


def group_by_file(names: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for n in sorted(names):
        out[file_of(n)].append(n)
    return dict(out)


def serving_quant_config(rule: str, mtp_rule: str, source: str) -> dict:
    return {
        "quant_method": SERVING_QUANT_METHOD,
        "format": "mxfp4",
        "block_size": 32,
        "scale_format": "e8m0",
        "packing": "e2m1, two per byte, element 2j in the low nibble",
        "layout": "routed_experts fused: w13 = [gate; up] rows per expert, experts stacked",
        "quantized": "routed experts of every MoE layer and of the MTP layer; all else unquantised",
        "rule": rule,
        "mtp_rule": mtp_rule,
        "source": source,
    }


def check_mxfp4_dims(cfg: ModelConfig) -> None:
    for name, v in (
        ("hidden_size", cfg.hidden_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
    ):
        if v % 32:
            raise ValueError(
                f"{name}={v} is not a multiple of 32: MXFP4 blocks of 32 along the input dimension "
                "need it"
            )
