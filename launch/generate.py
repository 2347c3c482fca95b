"""`launch generate`: one prompt in, one completion out (JSON with --json)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from .engine_args import add_layout_args, build_engine, engine_config, model_dir

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    add_layout_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint)")
    g.add_argument(
        "--prompt-ids", help="comma-separated token ids, or @FILE to read them from a file"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def parse_ids(spec: str) -> list[int]:
    text = Path(spec[1:]).read_text() if spec.startswith("@") else spec
    try:
        return [int(t) for t in text.replace("\n", ",").split(",") if t.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-ids must be comma-separated integers, got {text[:60]!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.sampling.params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    d = model_dir(args)
    tok = load_tokenizer(d)
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{d} ships no tokenizer: pass --prompt-ids instead of --prompt")
        ids = tok.encode(args.prompt)
    else:
        ids = parse_ids(args.prompt_ids)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    engine = build_engine(engine_config(args, d))
    t1 = time.perf_counter()
    try:
        seq = engine.run([ids], params)[0]
    finally:
        engine.close()
    t2 = time.perf_counter()
    if seq.finish_reason == "error":
        raise RuntimeError(seq.error)
    text = tok.decode(seq.output) if tok is not None else None
    log.info("start %.2fs, generate %.2fs", t1 - t0, t2 - t1)
    if args.json:
        out = {
            "model": str(d),
            "token_ids": seq.output,
            "text": text,
            "finish_reason": seq.finish_reason,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(seq.output)},
            "layout": {"stages": args.stages, "tp": args.tp, "ep": args.ep, "mtp": args.mtp},
            "timing_s": {"start": round(t1 - t0, 3), "generate": round(t2 - t1, 3)},
        }
        if args.mtp:
            out["mtp"] = {
                "drafts": engine.stats.drafts_proposed,
                "accepted": engine.stats.drafts_accepted,
                "acceptance": engine.stats.acceptance,
                "decode_tokens_per_step": (len(seq.output) - 1) / max(seq.steps - 1, 1),
            }
        print(json.dumps(out))
    else:
        print(text if text is not None else ",".join(map(str, seq.output)))
    return 0
