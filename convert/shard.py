"""`convert shard`: split a checkpoint per pipeline stage and, inside each stage, per
expert-parallel rank.

Layer ranges come from the pure `partition_layers` (embedding on the first stage; final norm,
lm_head and the MTP layer on the last); expert ranges from `expert_ranges`. Each output directory
(stage-SS/ and stage-SS/ep-RR/, see dist_glm5/shards.py) has its own index and a manifest listing
every tensor's shape, dtype, byte count and sha256. Works on float (per-expert names) and MXFP4
serving (fused, stacked) checkpoints; bytes are copied, never re-encoded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path

from tqdm import tqdm

from dist_glm5.checkpoint.loader import check_checkpoint, meta_model
from dist_glm5.checkpoint.safetensors_io import Checkpoint, CheckpointError
from dist_glm5.checkpoint.shards import SHARDS_FILE, is_sharded, rank_dir, stage_dir
from dist_glm5.model.config import ModelConfig
from dist_glm5.planning.partition import expert_ranges, partition_layers

from .glm53 import source_files
from .layout import expert_key, group_by_file, layer_of
from .output import OutputDir, claim, write_json

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--src", required=True, help="checkpoint directory (HF float or our MXFP4 serving layout)"
    )
    p.add_argument(
        "--dst",
        required=True,
        help="output directory (new or empty; a rerun of the same job resumes)",
    )
    p.add_argument("--stages", type=int, required=True, help="pipeline stages (nodes)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per stage")
    p.set_defaults(func=lambda a: shard_checkpoint(a.src, a.dst, a.stages, a.ep) and 0)


def stages_of(name: str, cfg: ModelConfig, ranges: list[range]) -> list[int]:
    last = len(ranges) - 1
    i = layer_of(name)
    if i is None:
        if name.startswith("model.embed_tokens."):  # the MTP layer on the last stage embeds too
            return sorted({0, last}) if cfg.num_nextn_predict_layers else [0]
        return [last]
    if i >= cfg.num_hidden_layers:  # the MTP layer goes with the head
        return [last]
    return [next(s for s, r in enumerate(ranges) if i in r)]


def is_routed_expert(name: str) -> bool:
    return ".routed_experts." in name or expert_key(name) is not None


def shard_checkpoint(src: str | Path, dst: str | Path, stages: int, ep: int = 1) -> dict:
    src, dst = Path(src), Path(dst)
    if is_sharded(src):
        raise ValueError(f"{src} is already sharded: shard the unsharded checkpoint it came from")
    cfg = ModelConfig.from_hf(src)
    ranges = partition_layers(cfg, stages)
    eranges = expert_ranges(cfg.n_routed_experts, ep)
    ckpt = Checkpoint(src)
    check_checkpoint(meta_model(cfg), ckpt, src)
    job = {
        "tool": "shard",
        "source": str(src.resolve()),
        "source_config_sha256": hashlib.sha256((src / "config.json").read_bytes()).hexdigest(),
        "options": {"stages": stages, "ep": ep},
    }
    claim(dst, job)
    config = json.loads((src / "config.json").read_text())
    by_stage: dict[int, list[str]] = {s: [] for s in range(stages)}
    for n in ckpt.names():
        for s in stages_of(n, cfg, ranges):
            by_stage[s].append(n)
    parts = []
    with tqdm(total=stages * (1 + ep), desc="shard", leave=False) as bar:
        for s, names in by_stage.items():
            common = [n for n in names if not is_routed_expert(n)]
            out = OutputDir(stage_dir(dst, s), {**job, "part": f"stage {s}"})
            _copy_files(out, ckpt, common)
            out.finish(
                config, manifest_extra={"stage": s, "layers": [ranges[s].start, ranges[s].stop]}
            )
            parts.append(stage_dir(dst, s).relative_to(dst).as_posix())
            bar.update()
            experts = [n for n in names if is_routed_expert(n)]
            for r, er in enumerate(eranges):
                out = OutputDir(rank_dir(dst, s, r), {**job, "part": f"stage {s} ep {r}"})
                mine = [n for n in experts if expert_key(n) is None or expert_key(n)[2] in er]
                _copy_files(out, ckpt, mine, rows=er)
                out.finish(
                    config,
                    manifest_extra={"stage": s, "ep_rank": r, "experts": [er.start, er.stop]},
                )
                parts.append(rank_dir(dst, s, r).relative_to(dst).as_posix())
                bar.update()
    for f in source_files(src):
        (dst / f.name).write_bytes(f.read_bytes())
    meta = {
        "format": "dist_glm5-shards",
        "stages": stages,
        "ep": ep,
        "layers": [[r.start, r.stop] for r in ranges],
        "experts": [[r.start, r.stop] for r in eranges],
        "parts": parts,
        "source": str(src.resolve()),
    }
    write_json(dst / "config.json", config)
    write_json(dst / SHARDS_FILE, meta)
    log.info("shard: %d stages x %d EP ranks written to %s", stages, ep, dst)
    return meta


def _copy_files(
    out: OutputDir, ckpt: Checkpoint, names: list[str], rows: range | None = None
) -> None:
    """Copy `names` into `out`, one output file per source layer file; stacked experts keep only
    `rows`."""
    for fname, group in group_by_file(names).items():
        if out.is_done(fname):
            continue
        plan = []
        for n in group:
            info = ckpt.info(n)
            stacked = rows is not None and ".routed_experts." in n
            if stacked and info.shape[0] < rows.stop:
                raise CheckpointError(
                    f"{n} holds {info.shape[0]} experts, fewer than the EP split needs "
                    f"({rows.stop})"
                )
            plan.append((n, info.dtype, (len(rows), *info.shape[1:]) if stacked else info.shape))
        out.write(
            fname,
            plan,
            (
                (n, ckpt.read(n, rows if rows is not None and ".routed_experts." in n else None))
                for n in group
            ),
        )
