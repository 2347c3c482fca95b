"""`convert verify DIR`: check a converted or sharded directory against its manifests and its
config.

Per directory: every file the manifest lists is there with its size; every tensor is there with its
dtype, shape and sha256, and no tensor is there that the manifest does not list. Then the whole
(all stages and ranks together) must be exactly what the config's model needs
(loader.check_checkpoint).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from dist_glm5.checkpoint.loader import check_checkpoint, meta_model
from dist_glm5.checkpoint.safetensors_io import DTYPE_NAMES, Checkpoint, CheckpointError
from dist_glm5.checkpoint.shards import SHARDS_FILE, ShardedCheckpoint, is_sharded
from dist_glm5.model.config import ModelConfig

from .output import MANIFEST

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a directory written by convert glm53, glm52 or shard")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problems, counted = verify(args.dir)
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in {args.dir}:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(
        f"OK: {counted} tensors verified (bytes, shapes, dtypes, sha256) and consistent with the "
        f"config in {args.dir}"
    )
    return 0


def verify_part(d: Path) -> tuple[list[str], int]:
    mf = d / MANIFEST
    if not mf.exists():
        return [f"{d}: no {MANIFEST} (was this written by dist-glm5 convert?)"], 0
    m = json.loads(mf.read_text())
    problems = []
    for fn, size in m["files"].items():
        f = d / fn
        if not f.exists():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != size:
            problems.append(f"{f}: {f.stat().st_size} bytes, the manifest says {size}")
    if problems:
        return problems, 0
    try:
        ck = Checkpoint(d)
    except CheckpointError as e:
        return [str(e)], 0
    want, have = set(m["tensors"]), set(ck.names())
    for n in sorted(want - have):
        problems.append(f"{d}: tensor {n} is in the manifest but not in the files")
    for n in sorted(have - want):
        problems.append(f"{d}: tensor {n} is in the files but not in the manifest")
    for n in tqdm(sorted(want & have), desc=f"verify {d.name}", leave=False):
        t, info = m["tensors"][n], ck.info(n)
        if DTYPE_NAMES[info.dtype] != t["dtype"] or list(info.shape) != t["shape"]:
            problems.append(
                f"{d}: tensor {n} is {DTYPE_NAMES[info.dtype]} {list(info.shape)}, the manifest "
                f"says {t['dtype']} {t['shape']}"
            )
            continue
        data = ck.read(n)
        digest = hashlib.sha256(
            memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else b""
        ).hexdigest()
        if digest != t["sha256"]:
            problems.append(
                f"{d}: tensor {n} has sha256 {digest[:16]}..., the manifest says "
                f"{t['sha256'][:16]}..."
            )
    return problems, len(want & have)


def verify(path: str | Path) -> tuple[list[str], int]:
    root = Path(path)
    try:
        cfg = ModelConfig.from_hf(root)
    except ValueError as e:
        return [str(e)], 0
    if is_sharded(root):
        meta = json.loads((root / SHARDS_FILE).read_text())
        parts = [root / p for p in meta["parts"]]
    else:
        parts = [root]
    problems, counted = [], 0
    for p in parts:
        pr, n = verify_part(p)
        problems += pr
        counted += n
    if problems:
        return problems, counted
    try:
        whole = ShardedCheckpoint(root) if is_sharded(root) else Checkpoint(root)
        check_checkpoint(meta_model(cfg), whole, root)
    except CheckpointError as e:
        problems.append(str(e))
    return problems, counted
