"""Layout flags shared by the launch subcommands, and the engine (coordinator + pipeline) they build."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded small model)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages (one per node)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per stage (1 or --tp)")
    p.add_argument("--mtp", action="store_true", help="MTP speculative decoding (one draft per step)")
    p.add_argument("--address", help="an existing Ray cluster (ray start --head ...); default: a local one")
    p.add_argument("--host", default="127.0.0.1", help="address our sockets bind and advertise (this node's IP for multi-node)")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches in flight")
    p.add_argument("--chunk-tokens", type=int, default=256, help="prefill chunk size")
    p.add_argument("--cache-blocks", type=int, default=1024, help="paged-cache blocks per worker")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker")
    p.add_argument("--placement", help="expert-to-rank placement JSON (dist-glm5 placement fit)")


def model_dir(args: argparse.Namespace) -> Path:
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.checkpoint.default_model import ensure_default_model

    d = Path(args.model) if args.model else ensure_default_model()
    ModelConfig.from_hf(d)  # fail first on a directory that is not a checkpoint
    return d


def build_engine(args: argparse.Namespace, d: Path, max_model_len: int | None = None, dsa: dict | None = None,
                 profile: bool = False):
    """The coordinator over an in-process pipeline (one stage, one rank, no Ray) or Ray actors."""
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.stages.coordinator import Coordinator
    from dist_glm5.stages.inprocess_pipeline import InProcessPipeline
    from dist_glm5.stages.scheduler import SchedulerConfig
    from dist_glm5.stages.worker import StageSpec
    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    cfg = ModelConfig.from_hf(d)
    placement = None
    if getattr(args, "placement", None):
        from dist_glm5.planning.expert_placement import check_placement, load_placement

        placement = load_placement(args.placement)
        check_placement(cfg, placement)
    if args.stages * max(args.tp, args.ep) == 1 and not args.address:
        pipe = InProcessPipeline(StageSpec(str(d), mtp=args.mtp, cache_blocks=args.cache_blocks,
                                           block_size=args.block_size, dtype=args.dtype, threads=args.threads, dsa=dsa,
                                           placement=placement, profile=profile))
    else:
        from dist_glm5.stages.ray_pipeline import RayPipeline

        pipe = RayPipeline(str(d), stages=args.stages, tp=args.tp, ep=args.ep, mtp=args.mtp, address=args.address,
                           host=args.host, cache_blocks=args.cache_blocks, block_size=args.block_size,
                           dtype=args.dtype, threads=args.threads or 1, dsa=dsa, placement=placement, profile=profile)
    sched = SchedulerConfig(chunk_tokens=args.chunk_tokens, microbatches=args.microbatches, mtp=args.mtp,
                            max_model_len=max_model_len or min(cfg.max_position_embeddings,
                                                               args.cache_blocks * args.block_size))
    return Coordinator(pipe, sched, cfg.eos_token_id, cfg.vocab_size, load_tokenizer(d))
