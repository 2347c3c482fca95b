"""Load HF safetensors checkpoints into a Glm5Model, counting in both directions.

Every tensor the model needs must be present with the right shape and dtype, and every tensor in
the files must be used (or belong to layers another pipeline stage owns). Anything else is a
CheckpointError listing the names; weights are never zero-filled and nothing is skipped silently.
Routed experts are read from per-expert HF names (`mlp.experts.E.{gate,up,down}_proj.weight`) or
from the fused serving names (`mlp.experts.w13_weight` / `w2_weight`) and stored fused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .model import Glm5Model
from .safetensors_io import Checkpoint, CheckpointError

log = logging.getLogger(__name__)

# Tensors a bf16 release may keep in fp32 (transformers keeps them fp32; DeepSeek ships the bias in fp32).
_FP32_OK = re.compile(r"(mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias|indexer\.weights_proj\.weight|"
                      r"indexer\.k_norm\.(weight|bias))$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class _Source:
    ckpt_name: str
    shape: tuple[int, ...]
    assign: Callable[[torch.Tensor], None]


def _dtype_of(cfg: ModelConfig) -> torch.dtype:
    name = cfg.torch_dtype.replace("torch.", "")
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"config dtype {cfg.torch_dtype!r} is not one of float32, bfloat16, float16") from None


def _copy_into(dst: torch.Tensor, index=None):
    def assign(src: torch.Tensor) -> None:
        target = dst if index is None else dst[index]
        target.copy_(src.to(dst.dtype))
    return assign


def _expected(model: Glm5Model, ckpt: Checkpoint) -> dict[str, _Source]:
    """Map every checkpoint name the model needs to where its values go."""
    cfg = model.cfg
    out: dict[str, _Source] = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.w13_weight") or name.endswith("mlp.experts.w2_weight"):
            continue
        out[name] = _Source(name, tuple(p.shape), _copy_into(p.data))
    for mname, mod in model.named_modules():
        if not mname.endswith("mlp.experts"):
            continue
        w13, w2 = mod.w13_weight.data, mod.w2_weight.data
        I = cfg.moe_intermediate_size
        fused = f"{mname}.w13_weight"
        if fused in ckpt and mod.first_expert == 0 and mod.num_local == cfg.n_routed_experts:
            out[fused] = _Source(fused, tuple(w13.shape), _copy_into(w13))
            out[f"{mname}.w2_weight"] = _Source(f"{mname}.w2_weight", tuple(w2.shape), _copy_into(w2))
            continue
        for e in range(mod.num_local):
            g = mod.first_expert + e
            pre = f"{mname}.{g}"
            out[f"{pre}.gate_proj.weight"] = _Source(f"{pre}.gate_proj.weight", (I, cfg.hidden_size),
                                                     _copy_into(w13, (e, slice(0, I))))
            out[f"{pre}.up_proj.weight"] = _Source(f"{pre}.up_proj.weight", (I, cfg.hidden_size),
                                                   _copy_into(w13, (e, slice(I, 2 * I))))
            out[f"{pre}.down_proj.weight"] = _Source(f"{pre}.down_proj.weight", (cfg.hidden_size, I),
                                                     _copy_into(w2, e))
    # Optional per-MTP-layer head and embedding: used when the checkpoint carries them.
    if model.has_mtp:
        for j in range(cfg.num_nextn_predict_layers):
            layer = model.mtp_layer(j)
            pre = f"model.layers.{cfg.num_hidden_layers + j}"
            if f"{pre}.shared_head.head.weight" in ckpt:
                layer.shared_head.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(model.dtype)
                layer.shared_head.head.weight.requires_grad_(False)
                out[f"{pre}.shared_head.head.weight"] = _Source(f"{pre}.shared_head.head.weight",
                    (cfg.vocab_size, cfg.hidden_size), _copy_into(layer.shared_head.head.weight.data))
            if f"{pre}.embed_tokens.weight" in ckpt:
                layer.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(model.dtype)
                layer.embed_tokens.weight.requires_grad_(False)
                out[f"{pre}.embed_tokens.weight"] = _Source(f"{pre}.embed_tokens.weight",
                    (cfg.vocab_size, cfg.hidden_size), _copy_into(layer.embed_tokens.weight.data))
    return out


def _owned_elsewhere(model: Glm5Model, name: str) -> bool:
    """True for tensors that belong to another pipeline stage (only when this model is a stage)."""
    cfg = model.cfg
    m = _LAYER.match(name)
    if m:
        i = int(m.group(1))
        if i >= cfg.num_hidden_layers:
            return not model.has_mtp and i < cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        return i not in model.layer_range
    if name.startswith("model.embed_tokens."):
        return model.model.embed_tokens is None
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return model.lm_head is None
    return False


def load_checkpoint(model: Glm5Model, directory: str | Path) -> dict[str, int]:
    """Fill every weight of `model` from `directory`; return counts of what was loaded."""
    ckpt = Checkpoint(directory)
    cfg = model.cfg
    want_dtype = _dtype_of(cfg)
    expected = _expected(model, ckpt)
    have = set(ckpt.names())
    missing = sorted(set(expected) - have)
    unused = sorted(n for n in have - set(expected) if not _owned_elsewhere(model, n))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: {_show(missing)}")
    if unused:
        problems.append(f"{len(unused)} tensor(s) in the checkpoint are not used by the model "
                        f"(misnamed, or from another architecture/config): {_show(unused)}")
    for name in sorted(set(expected) & have):
        info = ckpt.info(name)
        src = expected[name]
        if info.shape != src.shape:
            problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(src.shape)}")
        ok = info.dtype == want_dtype or (info.dtype == torch.float32 and _FP32_OK.search(name))
        if not ok:
            problems.append(f"tensor {name} has dtype {info.dtype}, expected {want_dtype} (config dtype {cfg.torch_dtype})")
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not match the config:\n  - " + "\n  - ".join(problems))
    with torch.no_grad():
        for name, src in expected.items():
            src.assign(ckpt.get(name))
    log.info("loaded %d tensors (%d skipped as owned by other stages) from %s",
             len(expected), len(have) - len(expected), directory)
    return {"loaded": len(expected), "other_stages": len(have) - len(expected)}


def _show(names: list[str], limit: int = 12) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _skip_init:
    """Build modules without random-initialising weights the checkpoint overwrites anyway."""

    def __enter__(self):
        self._saved = [(nn.Linear, nn.Linear.reset_parameters), (nn.Embedding, nn.Embedding.reset_parameters)]
        for cls, _ in self._saved:
            cls.reset_parameters = lambda self: None

    def __exit__(self, *exc):
        for cls, fn in self._saved:
            cls.reset_parameters = fn


def load_model(directory: str | Path, dtype: torch.dtype | None = None, **stage) -> Glm5Model:
    """Config + weights from a checkpoint directory. dtype: compute dtype (default: the config's)."""
    cfg = ModelConfig.from_hf(directory)
    dtype = dtype or _dtype_of(cfg)
    with _skip_init():
        model = Glm5Model(cfg, **stage).to(dtype)
    for mname, mod in model.named_modules():  # the router computes in fp32 whatever the model dtype
        if mname.endswith("mlp.gate"):
            mod.float()
    load_checkpoint(model, directory)
    return model.eval()


def hf_state_dict(model: Glm5Model) -> dict[str, torch.Tensor]:
    """The model's weights under HF checkpoint names (fused experts split per expert)."""
    cfg = model.cfg
    I = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.experts.w13_weight"):
            pre = name[: -len(".w13_weight")]
            for e in range(p.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = p[e, :I].contiguous()
                out[f"{pre}.{e}.up_proj.weight"] = p[e, I:].contiguous()
        elif name.endswith("mlp.experts.w2_weight"):
            pre = name[: -len(".w2_weight")]
            for e in range(p.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = p[e].contiguous()
        else:
            out[name] = p.contiguous()
    return out
