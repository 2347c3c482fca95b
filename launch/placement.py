"""`dist-glm5 placement record|fit`: record expert routes from a real run, fit an expert-to-rank
placement."""

from __future__ import annotations

import argparse
import logging

from dist_glm5.backends import get_backend

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="placement_command", required=True)
    r = sub.add_parser(
        "record", help="run prompts through the model and record routes per expert, layer and step"
    )
    r.add_argument("--model", help="checkpoint directory (default: the embedded small model)")
    r.add_argument(
        "--prompts", type=int, default=8, help="random prompts to run (or --prompt-ids @FILE lines)"
    )
    r.add_argument("--prompt-len", type=int, default=128)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--output", required=True, help="routes JSON")
    r.set_defaults(func=record)
    f = sub.add_parser(
        "fit",
        help="fit a placement for EP ranks from recorded routes; prints the imbalance before/after",
    )
    f.add_argument("--model", help="checkpoint directory (its config), default: the embedded model")
    f.add_argument("--routes", required=True)
    f.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks")
    f.add_argument("--output", required=True, help="placement JSON, for --placement")
    f.add_argument(
        "--cards", type=int, help="also compare EP x TP splits of this many cards per stage"
    )
    f.set_defaults(func=fit)


def _dir(args):
    from pathlib import Path

    from dist_glm5.checkpoint.default_model import ensure_default_model

    return Path(args.model) if args.model else ensure_default_model()


def record(args: argparse.Namespace) -> int:
    import torch

    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.planning.expert_placement import RouteRecorder, attach
    from dist_glm5.sampling.params import SamplingParams

    m = load_model(_dir(args), ops=get_backend("cpu").ops())
    rec = RouteRecorder(m.cfg.n_routed_experts)
    attach(m, rec)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, min(256, m.cfg.vocab_size), (args.prompt_len,), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    generate(m, prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    rec.save(args.output)
    print(
        f"recorded routes of {len(rec.counts)} MoE layers over "
        f"{len(next(iter(rec.counts.values())))} forwards to {args.output}"
    )
    return 0


def fit(args: argparse.Namespace) -> int:
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.planning.expert_placement import (
        fit_placement,
        imbalance,
        load_routes,
        save_placement,
    )

    cfg = ModelConfig.from_hf(_dir(args))
    routes = load_routes(args.routes)
    pl = fit_placement(routes, args.ranks, cfg)
    save_placement(args.output, pl, args.ranks)
    print(
        f"busiest EP rank / mean over recorded steps, {args.ranks} ranks: before "
        f"{imbalance(routes, None, args.ranks):.3f}, after {imbalance(routes, pl, args.ranks):.3f} "
        f"-> {args.output}"
    )
    if args.cards:
        from dist_glm5.planning.expert_placement import layouts

        print(
            f"EP x TP over {args.cards} cards (busiest rank's expert work per step, routes / TP; "
            "fitted placements):"
        )
        for r in layouts(routes, args.cards, cfg):
            print(
                f"  EP{r['ep']} x TP{r['tp']}: {r['busiest_rank_work']:.2f} (imbalance "
                f"{r['imbalance']:.3f})"
            )
    return 0
