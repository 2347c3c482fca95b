"""`convert glm52`: AMD's Quark MXFP4 checkpoint of GLM-5.2 -> our fused serving layout, byte for
byte.

Quark exports each quantised linear as `X.weight` uint8 [out, in/2] (E2M1 pairs, low nibble first)
and `X.weight_scale` uint8 [out, in/32] (E8M0). Routed experts are repacked into the fused layout
by copying those bytes (no dequantise/requantise). Shared experts, and any other quantised linear,
are decoded to the checkpoint dtype (exact: every MXFP4 value is a bf16 value). Routed experts the
release ships unquantised (GLM-5.2's MTP layer) are encoded with --mtp-rule (the served GLM-5.2
used the OCP floor rule).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from dist_glm5.checkpoint.loader import _dtype_of, check_checkpoint, meta_model
from dist_glm5.checkpoint.safetensors_io import Checkpoint, CheckpointError
from dist_glm5.checkpoint.shards import _Info
from dist_glm5.model.config import ModelConfig
from dist_glm5.quant.mxfp4 import RULES, decode

from .glm53 import expert_stream, source_files
from .layout import (
    check_mxfp4_dims,
    expert_key,
    fused_names,
    fused_shapes,
    group_by_file,
    serving_quant_config,
)
from .output import OutputDir

log = logging.getLogger(__name__)
SCALE = ".weight_scale"


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--src", required=True, help="AMD Quark MXFP4 checkpoint directory (quant_method: quark)"
    )
    p.add_argument(
        "--dst",
        required=True,
        help="output directory (new or empty; a rerun of the same job resumes)",
    )
    p.add_argument(
        "--mtp-rule",
        choices=RULES,
        default="ocp",
        help="rule for routed experts the release ships unquantised "
        "(GLM-5.2's MTP layer was served with ocp)",
    )
    p.set_defaults(func=lambda a: convert_glm52(a.src, a.dst, a.mtp_rule) and 0)


def check_quark_config(q: dict | None, where: Path) -> None:
    if not q or q.get("quant_method") != "quark":
        raise ValueError(
            f"{where}: config.json has no Quark quantization_config (quant_method 'quark'): "
            "glm52 repacks AMD's Quark MXFP4 export; for the BF16 release use `convert glm53`"
        )
    w = (q.get("global_quant_config") or {}).get("weight") or {}
    if (w.get("dtype"), w.get("group_size"), w.get("scale_format")) != ("fp4", 32, "e8m0"):
        raise ValueError(
            f"{where}: Quark weight format "
            f"{w.get('dtype')}/{w.get('group_size')}/{w.get('scale_format')} is not MXFP4 (fp4 "
            "elements, group 32, e8m0 scales)"
        )
    if (q.get("export") or {}).get("weight_format", "real_quantized") != "real_quantized":
        raise ValueError(
            f"{where}: Quark export is not real_quantized (packed bytes); re-export with real "
            "quantisation"
        )


class QuarkView:
    """The source as the float model would see it: a quantised `X.weight` appears with its float
    shape, so the ordinary both-ways check (loader.check_checkpoint) finds missing, extra and
    misshaped tensors; packed/scale pairs are checked against each other here."""

    def __init__(self, ck: Checkpoint, wdt: torch.dtype):
        self.ck, self.wdt = ck, wdt
        self.quantised: set[str] = set()
        problems = []
        for n in ck.names():
            if not n.endswith(SCALE):
                continue
            w = n[: -len(SCALE)] + ".weight"
            if w not in ck:
                problems.append(f"{n} has no {w} beside it")
                continue
            pi, si = ck.info(w), ck.info(n)
            if (
                pi.dtype != torch.uint8
                or si.dtype != torch.uint8
                or len(pi.shape) != 2
                or si.shape != (pi.shape[0], pi.shape[1] * 2 // 32)
            ):
                problems.append(
                    f"{w} {pi.dtype} {list(pi.shape)} with scale {si.dtype} {list(si.shape)} is "
                    "not an MXFP4 pair (uint8 [out, in/2] and uint8 [out, in/32])"
                )
                continue
            self.quantised.add(w)
        for n in ck.names():
            if (
                ck.info(n).dtype == torch.uint8
                and not n.endswith(SCALE)
                and n not in self.quantised
            ):
                problems.append(f"{n} is uint8 but has no {SCALE} beside it")
        if problems:
            raise CheckpointError(
                f"{ck.dir}: malformed Quark MXFP4 tensors:\n  - " + "\n  - ".join(problems)
            )

    def names(self) -> list[str]:
        return [n for n in self.ck.names() if not n.endswith(SCALE)]

    def __contains__(self, name: str) -> bool:
        return name in self.ck and not name.endswith(SCALE)

    def info(self, name: str):
        i = self.ck.info(name)
        if name in self.quantised:
            return _Info(self.wdt, (i.shape[0], i.shape[1] * 2))
        return i


def convert_glm52(src: str | Path, dst: str | Path, mtp_rule: str = "ocp") -> dict:
    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_hf(src)
    check_quark_config(cfg.quantization_config, src)
    check_mxfp4_dims(cfg)
    float_cfg = replace(cfg, quantization_config=None)
    wdt = _dtype_of(cfg)
    ck = Checkpoint(src)
    view = QuarkView(ck, wdt)
    check_checkpoint(meta_model(float_cfg), view, src)
    job = {
        "tool": "glm52",
        "source": str(src.resolve()),
        "source_config_sha256": hashlib.sha256((src / "config.json").read_bytes()).hexdigest(),
        "options": {"mtp_rule": mtp_rule},
    }
    out = OutputDir(dst, job)
    shapes = fused_shapes(cfg)
    encoded_layers, dequantised = [], []
    with tqdm(total=len(view.names()), unit="tensor", desc="glm52", leave=False) as bar:
        for fname, names in group_by_file(view.names()).items():
            plain = [n for n in names if expert_key(n) is None]
            prefixes = sorted({expert_key(n)[0] for n in names if expert_key(n) is not None})
            modes = {}
            for pre in prefixes:
                q = {n in view.quantised for n in names if n.startswith(pre + ".")}
                if len(q) != 1:
                    raise CheckpointError(
                        f"{pre}: some routed experts are MXFP4 and some are not; "
                        "a MoE block must be all one or the other"
                    )
                modes[pre] = "copy" if q.pop() else "encode"
            dequantised += [n for n in plain if n in view.quantised]
            encoded_layers += [pre for pre, m in modes.items() if m == "encode"]
            if out.is_done(fname):
                bar.update(len(names))
                continue
            plan = [
                (n, wdt if n in view.quantised else ck.info(n).dtype, view.info(n).shape)
                for n in plain
            ]
            for pre in prefixes:
                plan += [
                    (name, torch.uint8, shapes[name.rsplit(".", 1)[1]]) for name in fused_names(pre)
                ]

            def stream(plain=plain, prefixes=prefixes, modes=modes):
                for n in plain:
                    if n in view.quantised:  # exact: E2M1 x 2^k is representable in bf16
                        yield n, decode(ck.read(n), ck.read(n[: -len(".weight")] + SCALE), wdt)
                    else:
                        yield n, ck.read(n)
                for pre in prefixes:
                    if modes[pre] == "copy":
                        yield from _repack_stream(ck, pre, cfg.n_routed_experts)
                    else:
                        yield from expert_stream(ck, pre, cfg.n_routed_experts, mtp_rule)

            out.write(fname, plan, stream())
            bar.update(len(names))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        **serving_quant_config(
            "quark", mtp_rule, "glm52: AMD Quark MXFP4 bytes repacked, not requantised"
        ),
        "encoded_with_mtp_rule": encoded_layers,
        "dequantised_to_" + str(wdt).replace("torch.", ""): len(dequantised),
    }
    manifest = out.finish(config, source_files(src))
    log.info(
        "glm52: repacked %s; encoded %s with %s; %d quantised non-expert linears decoded",
        dst,
        encoded_layers or "nothing",
        mtp_rule,
        len(dequantised),
    )
    return manifest


def _repack_stream(ck: Checkpoint, prefix: str, n_experts: int):
    """The fused tensors of one MoE block, made of the source's own bytes in [gate; up] order."""

    def parts(projs, kind):
        for e in range(n_experts):
            for proj in projs:
                yield ck.read(f"{prefix}.{e}.{proj}.{kind}")

    n13, s13, n2, s2 = fused_names(prefix)
    yield n13, parts(("gate_proj", "up_proj"), "weight")
    yield s13, parts(("gate_proj", "up_proj"), "weight_scale")
    yield n2, parts(("down_proj",), "weight")
    yield s2, parts(("down_proj",), "weight_scale")
