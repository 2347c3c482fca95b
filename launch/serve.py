"""`launch single-node --ctx 128k` and `launch two-node --ctx 637k`: plan, then serve.

The plan (dist_glm5/plan.py) is checked first and printed with --dry-run (which needs only a
config.json: plan before downloading 400 GB). Serving starts the pipeline (one stage per node, the
stage's cards as TP/EP ranks; on CPU one rank per stage unless --tp says otherwise) behind the
OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

from dist_glm5.engine.config import parse_ctx

from .api.limits import add_limit_args
from .engine_args import add_layout_args

log = logging.getLogger(__name__)
HW = {"hpu": dict(name="gaudi2", memory_per_card=96 * 10**9, cards_per_node=8, backend="hpu")}


def register(p: argparse.ArgumentParser, nodes: int, default_ctx: str) -> None:
    add_layout_args(p)
    p.set_defaults(stages=nodes)
    p.add_argument(
        "--ctx",
        type=parse_ctx,
        default=parse_ctx(default_ctx),
        help=f"context length (default {default_ctx})",
    )
    p.add_argument("--backend", choices=["cpu", "hpu"], default="cpu")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=os.environ.get("DIST_GLM5_API_KEY"), help="require this bearer token"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the memory plan and exit (needs only config.json)",
    )
    p.add_argument(
        "--weights-format",
        choices=["mxfp4", "fp8", "bf16"],
        help="default: from quantization_config",
    )
    p.add_argument("--cards-per-node", type=int, help="default: 8 on hpu, --tp on cpu")
    p.add_argument(
        "--memory-per-card-gb", type=float, help="default: 96 on hpu, this machine's memory on cpu"
    )
    p.add_argument(
        "--served-model-name", help="the model id clients ask for (default: the directory name)"
    )
    add_limit_args(p)
    p.set_defaults(func=run)


def hardware(args: argparse.Namespace):
    from dist_glm5.planning.cluster_fit import Hardware

    if args.backend == "hpu":
        hw = dict(HW["hpu"])
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        hw = dict(
            name="cpu",
            memory_per_card=mem // max(1, args.stages * max(args.tp, args.ep)),
            cards_per_node=max(args.tp, args.ep),
            backend="cpu",
        )
    if args.cards_per_node:
        hw["cards_per_node"] = args.cards_per_node
    if args.memory_per_card_gb:
        hw["memory_per_card"] = int(args.memory_per_card_gb * 10**9)
    return Hardware(**hw)


def run(args: argparse.Namespace) -> int:
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.planning.cluster_fit import Layout, check, table, weights_format_of

    from .engine_args import dsa_config

    d = Path(args.model) if args.model else ensure_default_model()
    cfg = ModelConfig.from_hf(d)
    layout = Layout(args.stages, hardware(args))
    fmt = args.weights_format or weights_format_of(cfg)
    kw = {} if args.backend == "hpu" else {"dsa": dsa_config(args)}  # sparse unless --dsa dense
    if args.dry_run:
        from dist_glm5.planning.cluster_fit import plan

        cards = plan(cfg, layout, args.ctx, fmt, **kw)
        print(table(cards, layout, args.ctx, fmt))
        check(cfg, layout, args.ctx, fmt, **kw)  # raises with what would fit
        return 0
    check(cfg, layout, args.ctx, fmt, **kw)
    if args.backend == "hpu":
        from dist_glm5.backends import get_backend
        from dist_glm5.backends.hpu import env as hpu_env

        for k, v in hpu_env.apply_defaults().items():  # only what the user left unset
            log.warning("hpu: %s=%s (default; export it to override)", k, v)
        # here, before any worker starts: says clearly what is missing on a machine without Gaudi
        backend = get_backend("hpu")
        log.warning(
            "hpu: ops %r on device %r, collectives %r",
            backend.ops().name,
            backend.device,
            backend.dist_backend,
        )
    return serve(args, d, cfg)


def serve(args: argparse.Namespace, d: Path, cfg) -> int:
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.engine.loop import EngineLoop

    from .api.app import build_app
    from .api.engine_client import EngineClient
    from .api.engine_request import ModelInfo
    from .api.limits import Limits
    from .api.server import HttpServer, ServerSettings
    from .engine_args import build_engine, engine_config

    t0 = time.perf_counter()
    # one sequence of --ctx: more requests queue for blocks (the scheduler admits, preempts)
    blocks = -(-(args.ctx + args.chunk_tokens) // args.block_size)
    engine = build_engine(engine_config(args, d, max_model_len=args.ctx, cache_blocks=blocks))
    loop = EngineLoop(engine)
    model = ModelInfo.from_model_dir(
        d, args.served_model_name or d.name, loop.max_model_len, cfg.vocab_size, load_tokenizer(d)
    )
    limits = Limits.from_args(args)
    settings = ServerSettings(host=args.host, port=args.port, limits=limits)
    client = EngineClient(loop)
    server = HttpServer(build_app(client, model, args.api_key, limits), settings)
    # uvicorn stops on SIGINT/SIGTERM and then re-raises the signal to the handler it found:
    # this one, so that the engine is closed (Ray actors included) before the process ends
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    log.warning(
        "serving %s on %s/v1 (%d stage(s), ready in %.1fs)",
        model.name,
        server.url,
        args.stages,
        time.perf_counter() - t0,
    )
    ready = {
        "event": "ready",
        "url": f"{server.url}/v1",
        "model": model.name,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(ready), flush=True)
    try:
        server.run()
    finally:
        client.close()
        loop.close()
    return 0
