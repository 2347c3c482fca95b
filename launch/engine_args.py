"""The engine flags shared by the launch subcommands, turned once into an `EngineConfig`, and the
engine (coordinator + pipeline) built from it. Parsed arguments are never modified."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout
from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.dsa_config import DSAConfig

log = logging.getLogger(__name__)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded small model)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages (one per node)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per stage (1 or --tp)")
    p.add_argument(
        "--mtp", action="store_true", help="MTP speculative decoding (one draft per step)"
    )
    p.add_argument(
        "--address", help="an existing Ray cluster (ray start --head ...); default: a local one"
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address our sockets bind and advertise (this node's IP for multi-node)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches in flight (default: one per stage, so every stage has work and a "
        "single stage decodes all its sequences in one step)",
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="prefill chunk size")
    p.add_argument("--cache-blocks", type=int, default=1024, help="paged-cache blocks per worker")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype (default: the checkpoint's)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker")
    p.add_argument("--placement", help="expert-to-rank placement JSON (dist-glm5 placement fit)")
    p.add_argument(
        "--dsa",
        choices=["sparse", "dense"],
        default="sparse",
        help="DSA attention: the scaled sparse path (default), or the dense masked reference "
        "(O(T^2): for checking, short prompts only)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a step's result before failing the earliest stage that has not "
        "finished it (a live but stuck worker; default: 300, room for long CPU prefill chunks)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds for the pipeline to start or restart (placement, workers, weights); a "
        "restart attempt past it fails and the next one tries again (default: 300)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds between a stage worker's heartbeats (default: 1)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds of heartbeat silence after which a worker is failed as frozen or "
        "unreachable (default: 10; /health is 503 once it is a third of the way there)",
    )
    p.add_argument(
        "--dsa-prefill",
        choices=["rows", "windows"],
        default=None,
        help="sparse prefill attention: each query over its own top-k rows (CPU default, "
        "measured fastest here) or union windows / dense below 32K (the Gaudi rule, its default)",
    )
    p.add_argument(
        "--index-keys",
        choices=["exact", "int8"],
        default="exact",
        help="the DSA indexer's keys in the cache: exact (the cache's dtype, default) or int8 with "
        "a scale per key (half the bytes, int8 products; selections may differ from exact ones at "
        "near-ties; sparse DSA on CPU only)",
    )


def model_dir(args: argparse.Namespace) -> Path:
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.model.config import ModelConfig

    d = Path(args.model) if args.model else ensure_default_model()
    ModelConfig.from_hf(d)  # fail first on a directory that is not a checkpoint
    return d


def dsa_config(args: argparse.Namespace) -> DSAConfig:
    """--dsa: "sparse" (the default in every command) or "dense" (the reference);
    --dsa-prefill: the sparse prefill form, by default the backend's (rows on CPU, windows on
    Gaudi); on Gaudi the windows' unions have static sizes (DSAConfig.static_union);
    --index-keys: DSAConfig.index_keys."""
    hpu = getattr(args, "backend", "cpu") == "hpu"
    prefill = getattr(args, "dsa_prefill", None) or ("windows" if hpu else "rows")
    mode = "reference" if getattr(args, "dsa", "sparse") == "dense" else "sparse"
    keys = getattr(args, "index_keys", "exact")
    return DSAConfig(mode=mode, prefill_attention=prefill, static_union=hpu, index_keys=keys)


def engine_config(
    args: argparse.Namespace,
    d: Path,
    *,
    max_model_len: int | None = None,
    dsa: DSAConfig | None = None,
    profile: bool = False,
    cache_blocks: int | None = None,
) -> EngineConfig:
    """The one configuration from the flags (and what the subcommand decides: context, DSA path,
    profiling, a cache sized for its context)."""
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.planning.expert_placement import check_placement, load_placement

    cfg = ModelConfig.from_hf(d)
    placement = None
    if getattr(args, "placement", None):
        placement = load_placement(args.placement)
        check_placement(cfg, placement)
    cache = CacheConfig(cache_blocks or args.cache_blocks, args.block_size)
    sched = SchedulerConfig(
        chunk_tokens=args.chunk_tokens,
        microbatches=args.microbatches or args.stages,
        max_model_len=max_model_len or min(cfg.max_position_embeddings, cache.tokens),
    )
    return EngineConfig(
        str(d),
        Layout(args.stages, args.tp, args.ep),
        cache,
        sched,
        dsa or dsa_config(args),
        mtp=args.mtp,
        dtype=args.dtype,
        threads=args.threads,
        placement=placement,
        profile=profile,
        address=args.address,
        host=args.host,
        backend=getattr(args, "backend", "cpu"),
        step_timeout=getattr(args, "step_timeout", 300.0),
        heartbeat_interval=getattr(args, "heartbeat_interval", 1.0),
        heartbeat_timeout=getattr(args, "heartbeat_timeout", 10.0),
        startup_timeout=getattr(args, "startup_timeout", 300.0),
    )


def build_engine(engine: EngineConfig):
    """The coordinator over an in-process pipeline (one stage, one rank, no Ray) or Ray actors."""
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.engine.config import StageSpec
    from dist_glm5.engine.coordinator import Coordinator
    from dist_glm5.model.config import ModelConfig

    cfg = ModelConfig.from_hf(engine.model_dir)
    if engine.in_process:
        from dist_glm5.stages.inprocess_pipeline import InProcessPipeline

        pipe = InProcessPipeline(StageSpec(engine))
    else:
        from dist_glm5.stages.ray_pipeline import RayPipeline

        pipe = RayPipeline(engine)
    return Coordinator(
        pipe,
        engine.scheduler,
        cfg.eos_token_id,
        cfg.vocab_size,
        load_tokenizer(engine.model_dir),
        step_timeout=engine.step_timeout,
    )
