"""`dist-glm5 bench roofline`: the bytes each card reads per decode step and the bound they set,
printed per stage. The model of those bytes is dist_glm5/planning/roofline.py (COMPUTED; `launch
profile` holds its measured steps against the same model)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from dist_glm5.model.config import ModelConfig
from dist_glm5.planning.roofline import GB, HBM, decode_bytes


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="config directory (default: GLM-5's shapes)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--tokens-per-seq",
        type=float,
        default=1.95,
        help="MTP: tokens verified per sequence per step",
    )
    p.add_argument(
        "--hw",
        choices=["gaudi2", "this-machine"],
        default="gaudi2",
        help="gaudi2: HBM's published 2.45 TB/s per card; this-machine: one worker's read "
        "bandwidth measured here at --threads",
    )
    p.add_argument("--threads", type=int, default=1, help="with --hw this-machine")
    p.add_argument("--output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = ModelConfig.from_hf(args.model) if args.model else ModelConfig(num_nextn_predict_layers=1)
    if args.hw == "this-machine":
        from dist_glm5.obs.bandwidth import read_bandwidth

        bw = read_bandwidth(args.threads)
        hw = HBM(f"this machine ({args.threads} thread(s), measured)", bw, 1)
    else:
        hw = HBM()
    rows = decode_bytes(cfg, args.nodes, args.ctx, args.batch, round(args.tokens_per_seq), hw)
    print(
        f"decode-step roofline (COMPUTED bytes, not a measured step): {args.nodes} node(s) x "
        f"{hw.cards_per_node} {hw.name} worker(s), {hw.bandwidth / 1e9:.1f} GB/s each, context "
        f"{args.ctx}, batch {args.batch}"
    )
    for r in rows:
        parts = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in asdict(r).items() if k != "stage")
        print(
            f"  stage {r.stage}: {r.total / GB:.2f} GB per card -> >= "
            f"{1e3 * r.total / hw.bandwidth:.2f} ms ({parts})"
        )
    if args.output:
        Path(args.output).write_text(
            json.dumps([asdict(r) | {"total": r.total} for r in rows], indent=1)
        )
    return 0
