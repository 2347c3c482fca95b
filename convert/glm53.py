"""`convert glm53`: the GLM-5.3 BF16 release -> our MXFP4 serving checkpoint.

Routed experts of every MoE layer and of the MTP layer are encoded (Quark's rule by default, the
bytes AMD's own quantiser writes) and fused into the serving layout; shared experts and every
other tensor are copied byte for byte. Streams expert by expert: memory does not grow with the
checkpoint. Resumable: see convert/output.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from dist_glm5.checkpoint.loader import check_checkpoint, meta_model
from dist_glm5.checkpoint.safetensors_io import Checkpoint
from dist_glm5.model.config import ModelConfig
from dist_glm5.quant.mxfp4 import RULES, encode

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
SMALL_FILES_SKIP = {
    "config.json",
    "model.safetensors.index.json",
    "manifest.json",
    "job.json",
    "shards.json",
}


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="BF16 checkpoint directory (HF layout)")
    p.add_argument(
        "--dst",
        required=True,
        help="output directory (new or empty; a rerun of the same job resumes)",
    )
    p.add_argument(
        "--rule",
        choices=RULES,
        default="quark",
        help="MXFP4 scale rule (default: quark, as GLM-5.3 was served)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="encoder threads (default: all cores)",
    )
    p.set_defaults(func=lambda a: convert_glm53(a.src, a.dst, a.rule, a.workers) and 0)


def source_files(src: Path) -> list[Path]:
    """The small files to carry over (tokenizer, generation config, chat template, ...)."""
    return [
        p
        for p in sorted(src.iterdir())
        if p.is_file()
        and p.suffix != ".safetensors"
        and p.name not in SMALL_FILES_SKIP
        and not p.name.startswith(".")
    ]


def ordered_map(fn, items, workers: int):
    """fn over items on `workers` threads (torch ops release the GIL), results in order, at most
    2 x workers in flight so memory stays bounded."""
    items = list(items)
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as ex:
        pending = deque()
        for it in items:
            pending.append(ex.submit(fn, it))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def expert_stream(ckpt: Checkpoint, prefix: str, n_experts: int, rule: str, workers: int = 1):
    """(name, parts) for the four fused tensors of one MoE block; encodes expert matrices on
    `workers` threads, a few at a time."""
    scales = {"w13": [], "w2": []}

    def weights(kind: str):
        projs = ("gate_proj", "up_proj") if kind == "w13" else ("down_proj",)
        names = [f"{prefix}.{e}.{proj}.weight" for e in range(n_experts) for proj in projs]
        for packed, s in ordered_map(lambda n: encode(ckpt.read(n), rule), names, workers):
            scales[kind].append(s)
            yield packed

    def scale_parts(kind: str):
        yield from scales[kind]
        scales[kind].clear()

    n13, s13, n2, s2 = fused_names(prefix)
    yield n13, weights("w13")
    yield s13, scale_parts("w13")
    yield n2, weights("w2")
    yield s2, scale_parts("w2")


def convert_glm53(src: str | Path, dst: str | Path, rule: str = "quark", workers: int = 1) -> dict:
    src, dst = Path(src), Path(dst)
    raw_cfg = (
        json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else None
    )
    cfg = ModelConfig.from_hf(src)
    if cfg.quantization_config:
        raise ValueError(
            f"{src} is already quantised ({cfg.quantization_config.get('quant_method')}): "
            "glm53 takes the BF16 release; for AMD's Quark MXFP4 checkpoint use `convert glm52`"
        )
    check_mxfp4_dims(cfg)
    ckpt = Checkpoint(src)
    check_checkpoint(
        meta_model(cfg), ckpt, src
    )  # every tensor present, used, right shape and dtype
    job = {
        "tool": "glm53",
        "source": str(src.resolve()),
        "source_config_sha256": hashlib.sha256((src / "config.json").read_bytes()).hexdigest(),
        "options": {"rule": rule},
    }
    out = OutputDir(dst, job)
    shapes = fused_shapes(cfg)
    groups = group_by_file(ckpt.names())
    total = sum(ckpt.info(n).nbytes for n in ckpt.names())
    with tqdm(total=total, unit="B", unit_scale=True, desc="glm53", leave=False) as bar:
        for fname, names in groups.items():
            nbytes = sum(ckpt.info(n).nbytes for n in names)
            if out.is_done(fname):
                bar.update(nbytes)
                continue
            plain = [n for n in names if expert_key(n) is None]
            prefixes = sorted({expert_key(n)[0] for n in names if expert_key(n) is not None})
            plan = [(n, ckpt.info(n).dtype, ckpt.info(n).shape) for n in plain]
            for pre in prefixes:
                plan += [
                    (name, torch.uint8, shapes[name.rsplit(".", 1)[1]]) for name in fused_names(pre)
                ]

            def stream(plain=plain, prefixes=prefixes):
                for n in plain:
                    yield n, ckpt.read(n)
                for pre in prefixes:
                    yield from expert_stream(ckpt, pre, cfg.n_routed_experts, rule, workers)

            out.write(fname, plan, stream())
            bar.update(nbytes)
    config = dict(raw_cfg)
    config["quantization_config"] = serving_quant_config(
        rule, rule, "glm53: BF16 release, experts encoded"
    )
    manifest = out.finish(config, source_files(src))
    log.info("glm53: wrote %d tensors to %s", len(manifest["tensors"]), dst)
    return manifest
