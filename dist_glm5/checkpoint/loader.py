"""Load HF safetensors checkpoints into a Glm5Model, counting in both directions.

Every tensor the model needs must be present with the right shape and dtype, and every tensor in
the files must be used (or belong to layers another pipeline stage owns). Anything else is a
CheckpointError listing the names; weights are never zero-filled and nothing is skipped silently.
Routed experts are read from per-expert HF names (`mlp.experts.E.{gate,up,down}_proj.weight`,
float) or, in a serving checkpoint, from the fused MXFP4 names
`mlp.experts.routed_experts.{w13_weight,w13_weight_scale,w2_weight,w2_weight_scale}` (uint8,
experts stacked; an expert-parallel rank takes its rows).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dist_glm5.checkpoint.safetensors_io import Checkpoint, CheckpointError
from dist_glm5.checkpoint.shards import open_checkpoint
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.glm5 import Glm5Model
from dist_glm5.model.linear import Linear
from dist_glm5.model.moe import MXFP4Experts
from dist_glm5.ops import Ops, reference_ops

log = logging.getLogger(__name__)

# Tensors a bf16 release may keep in fp32 (transformers keeps them fp32; DeepSeek ships the bias in
# fp32).
_FP32_OK = re.compile(
    r"(mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias|indexer\.weights_proj\.weight|"
    r"indexer\.k_norm\.(weight|bias))$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
MXFP4_EXPERT_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


@dataclass
class _Source:
    shape: tuple[int, ...]  # expected shape in the checkpoint
    dtypes: tuple[torch.dtype, ...]  # allowed checkpoint dtypes
    assign: Callable[[torch.Tensor], None]
    rows: range | list[int] | None = (
        None  # stacked experts: the expert rows needed (the tensor may hold more)
    )


def _dtype_of(cfg: ModelConfig) -> torch.dtype:
    name = cfg.torch_dtype.replace("torch.", "")
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    except KeyError:
        raise ValueError(
            f"config dtype {cfg.torch_dtype!r} is not one of float32, bfloat16, float16"
        ) from None


def _copy_into(dst: torch.Tensor, index=None, rows: slice | None = None):
    def assign(src: torch.Tensor) -> None:
        target = dst if index is None else dst[index]
        target.copy_((src if rows is None else src[rows]).to(dst.dtype))

    return assign


def _layer_of_module(mname: str) -> int:
    return int(mname.split(".")[2])


def local_expert_ids(
    model: Glm5Model, layer: int, placement: dict[int, list[int]] | None
) -> list[int]:
    """The checkpoint expert ids this model holds in `layer`, in its local order: a contiguous range
    of expert positions, which a placement maps to any set of experts."""
    perm = (placement or {}).get(layer)
    return [perm[j] for j in model.experts] if perm is not None else list(model.experts)


def _expected(
    model: Glm5Model, ckpt: Checkpoint, placement: dict[int, list[int]] | None = None
) -> dict[str, _Source]:
    """Map every checkpoint name the model needs to its shape, allowed dtypes and destination."""
    cfg = model.cfg
    wdt = _dtype_of(cfg)
    out: dict[str, _Source] = {}
    experts = {m: mod for m, mod in model.named_modules() if m.endswith("mlp.experts")}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.rsplit(".", 1)[0] in experts:
            continue
        ok = (wdt, torch.float32) if _FP32_OK.search(name) else (wdt,)
        out[name] = _Source(tuple(t.shape), ok, _copy_into(t.data))
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for mname, mod in experts.items():
        ids = local_expert_ids(model, _layer_of_module(mname), placement)
        rows = range(ids[0], ids[-1] + 1) if ids == list(range(ids[0], ids[-1] + 1)) else ids
        if isinstance(mod, MXFP4Experts):
            for t in MXFP4_EXPERT_TENSORS:
                buf = getattr(mod, t)
                out[f"{mname}.routed_experts.{t}"] = _Source(
                    tuple(buf.shape), (torch.uint8,), _copy_into(buf), rows=rows
                )
            continue
        w13, w2 = mod.w13_weight.data, mod.w2_weight.data
        for e, g in enumerate(ids):
            pre = f"{mname}.{g}"
            out[f"{pre}.gate_proj.weight"] = _Source(
                (I, H), (wdt,), _copy_into(w13, (e, slice(0, I)))
            )
            out[f"{pre}.up_proj.weight"] = _Source(
                (I, H), (wdt,), _copy_into(w13, (e, slice(I, 2 * I)))
            )
            out[f"{pre}.down_proj.weight"] = _Source((H, I), (wdt,), _copy_into(w2, e))
    # Optional per-MTP-layer head and embedding: used when the checkpoint carries them.
    if model.has_mtp:
        for j in range(cfg.num_nextn_predict_layers):
            layer = model.mtp_layer(j)
            pre = f"model.layers.{cfg.num_hidden_layers + j}"
            if f"{pre}.shared_head.head.weight" in ckpt:
                layer.shared_head.head = (
                    Linear(H, cfg.vocab_size, False, model.ops)
                    .to(model.dtype)
                    .requires_grad_(False)
                )
                out[f"{pre}.shared_head.head.weight"] = _Source(
                    (cfg.vocab_size, H), (wdt,), _copy_into(layer.shared_head.head.weight.data)
                )
            if f"{pre}.embed_tokens.weight" in ckpt:
                layer.embed_tokens = (
                    nn.Embedding(cfg.vocab_size, H).to(model.dtype).requires_grad_(False)
                )
                out[f"{pre}.embed_tokens.weight"] = _Source(
                    (cfg.vocab_size, H), (wdt,), _copy_into(layer.embed_tokens.weight.data)
                )
    return out


def _owned_elsewhere(
    model: Glm5Model, name: str, placement: dict[int, list[int]] | None = None
) -> bool:
    """True for tensors that belong to another pipeline stage or expert-parallel rank."""
    cfg = model.cfg
    m = _LAYER.match(name)
    if m:
        i = int(m.group(1))
        if i >= cfg.num_hidden_layers:
            if not model.has_mtp and i < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
                return True
        elif i not in model.layer_range:
            return True
    e = _PER_EXPERT.search(name)
    if (
        e
        and m
        and int(e.group(1)) < cfg.n_routed_experts
        and int(e.group(1)) not in local_expert_ids(model, int(m.group(1)), placement)
    ):
        return True  # another expert-parallel rank's expert
    if name.startswith("model.embed_tokens."):
        return model.model.embed_tokens is None
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return model.lm_head is None
    return False


def check_checkpoint(
    model: Glm5Model,
    ckpt: Checkpoint,
    where: str | Path,
    placement: dict[int, list[int]] | None = None,
) -> dict[str, _Source]:
    """Compare the checkpoint's headers with what `model` needs, in both directions; raise listing
    every problem."""
    q = model.cfg.quantization_config or {}
    if q.get("quant_method") == "quark":
        raise CheckpointError(
            f"{where} is an AMD Quark checkpoint: repack it into the serving layout first with "
            f"`dist-glm5 convert glm52 --src {where} --dst DIR`"
        )
    if q and model.cfg.experts_format == "float":
        raise CheckpointError(
            f"{where}: quantization_config {q.get('quant_method')!r} is not served; "
            "serve the BF16 release converted with `dist-glm5 convert glm53`"
        )
    expected = _expected(model, ckpt, placement)
    have = set(ckpt.names())
    missing = sorted(set(expected) - have)
    unused = sorted(n for n in have - set(expected) if not _owned_elsewhere(model, n, placement))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: {_show(missing)}")
    if unused:
        problems.append(
            f"{len(unused)} tensor(s) in the checkpoint are not used by the model "
            f"(misnamed, or from another architecture/config): {_show(unused)}"
        )
    for name in sorted(set(expected) & have):
        info = ckpt.info(name)
        src = expected[name]
        if (
            src.rows is not None
        ):  # stacked experts: the checkpoint's rows must cover this rank's experts
            off = ckpt.row_offset(name) if hasattr(ckpt, "row_offset") else 0
            held = range(off, off + (info.shape[0] if info.shape else 0))
            if info.shape[1:] != src.shape[1:] or not all(
                r in held
                for r in (
                    src.rows if isinstance(src.rows, list) else (src.rows.start, src.rows.stop - 1)
                )
            ):
                problems.append(
                    f"tensor {name} has shape {list(info.shape)} holding experts "
                    f"{held.start}..{held.stop - 1}, expected [*, "
                    f"{', '.join(map(str, src.shape[1:]))}] covering experts "
                    f"{min(src.rows)}..{max(src.rows)}"
                )
            elif isinstance(src.rows, list):
                src.rows = [r - off for r in src.rows]
            else:
                src.rows = range(src.rows.start - off, src.rows.stop - off)
        elif info.shape != src.shape:
            problems.append(
                f"tensor {name} has shape {list(info.shape)}, expected {list(src.shape)}"
            )
        if info.dtype not in src.dtypes:
            want = " or ".join(str(d) for d in src.dtypes)
            problems.append(
                f"tensor {name} has dtype {info.dtype}, expected {want} (config dtype "
                f"{model.cfg.torch_dtype})"
            )
    if problems:
        raise CheckpointError(
            f"checkpoint {where} does not match the config:\n  - " + "\n  - ".join(problems)
        )
    return expected


def load_checkpoint(
    model: Glm5Model,
    directory: str | Path,
    shard: tuple[int | None, int | None] = (None, None),
    placement: dict[int, list[int]] | None = None,
) -> dict[str, int]:
    """Fill every weight of `model` from `directory` (plain, or sharded: `shard` = (stage, ep_rank)
    selects the part to open); return counts of what was loaded. With a placement (per MoE layer,
    the checkpoint expert id at each expert position), experts and router rows are loaded
    permuted."""
    ckpt = open_checkpoint(directory, *shard)
    expected = check_checkpoint(model, ckpt, directory, placement)
    with torch.no_grad():
        for name, src in expected.items():
            t = ckpt.get(name)
            if isinstance(src.rows, list):
                t = t.index_select(0, torch.tensor(src.rows))
            elif src.rows is not None:
                t = t[src.rows.start : src.rows.stop]
            src.assign(t)
        for layer, perm in (
            placement or {}
        ).items():  # the router now names expert positions, not ids
            key = str(layer)
            if key in model.model.layers and hasattr(model.model.layers[key].mlp, "gate"):
                gate = model.model.layers[key].mlp.gate
                idx = torch.tensor(perm)
                gate.weight.data = gate.weight.data[idx].contiguous()
                gate.e_score_correction_bias.data = gate.e_score_correction_bias.data[
                    idx
                ].contiguous()
    skipped = len(ckpt.names()) - len(expected)
    log.info(
        "loaded %d tensors (%d skipped as owned by other stages) from %s",
        len(expected),
        skipped,
        directory,
    )
    return {"loaded": len(expected), "other_stages": skipped}


def meta_model(cfg: ModelConfig, **stage) -> Glm5Model:
    """The model's structure without memory: enough to list the tensors a checkpoint must hold.
    Built with the references: no op runs on a meta model, and the ops change no tensor."""
    with torch.device("meta"):
        return Glm5Model(cfg, ops=reference_ops(), **stage)


def _show(names: list[str], limit: int = 12) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _skip_init:
    """Build modules without random-initialising weights the checkpoint overwrites anyway."""

    def __enter__(self):
        self._saved = [
            (nn.Linear, nn.Linear.reset_parameters),
            (nn.Embedding, nn.Embedding.reset_parameters),
        ]
        for cls, _ in self._saved:
            cls.reset_parameters = lambda self: None

    def __exit__(self, *exc):
        for cls, fn in self._saved:
            cls.reset_parameters = fn


def load_model(
    directory: str | Path,
    dtype: torch.dtype | None = None,
    shard: tuple[int | None, int | None] = (None, None),
    placement: dict[int, list[int]] | None = None,
    *,
    ops: Ops,
    **stage,
) -> Glm5Model:
    """Config + weights from a checkpoint directory. dtype: compute dtype (default: the config's).
    ops: the hot ops, the caller's choice (its backend's, or `get_backend("cpu").ops()`).
    `stage` keywords (layers=, experts=, ...) build one pipeline stage / EP rank of the model."""
    cfg = ModelConfig.from_hf(directory)
    dtype = dtype or _dtype_of(cfg)
    with _skip_init():
        model = Glm5Model(cfg, ops=ops, **stage).to(dtype)
    for mname, mod in model.named_modules():  # the router computes in fp32 whatever the model dtype
        if mname.endswith("mlp.gate"):
            mod.float()
    if placement:
        from dist_glm5.planning.expert_placement import check_placement

        check_placement(cfg, placement)
    load_checkpoint(model, directory, shard, placement)
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
