"""`launch generate`: one prompt in, one completion out (JSON with --json)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded small model)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs a tokenizer in the checkpoint)")
    g.add_argument("--prompt-ids", help="comma-separated token ids, or @FILE to read them from a file")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def parse_ids(spec: str) -> list[int]:
    text = Path(spec[1:]).read_text() if spec.startswith("@") else spec
    try:
        return [int(t) for t in text.replace("\n", ",").split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text[:60]!r}") from None


def run(args: argparse.Namespace) -> int:
    from dist_glm5.config import ModelConfig
    from dist_glm5.default_model import ensure_default_model
    from dist_glm5.generate import generate
    from dist_glm5.loader import load_model
    from dist_glm5.sampling import SamplingParams
    from dist_glm5.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model()
    ModelConfig.from_hf(model_dir)  # fail first on a directory that is not a checkpoint
    tok = load_tokenizer(model_dir)
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{model_dir} ships no tokenizer: pass --prompt-ids instead of --prompt")
        ids = tok.encode(args.prompt)
    else:
        ids = parse_ids(args.prompt_ids)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype=getattr(torch, args.dtype) if args.dtype else None)
    t1 = time.perf_counter()
    out = generate(model, [ids], params)[0]
    t2 = time.perf_counter()
    text = tok.decode(out.token_ids) if tok is not None else None
    log.info("load %.2fs, generate %.2fs", t1 - t0, t2 - t1)
    if args.json:
        print(json.dumps({"model": str(model_dir), "token_ids": out.token_ids, "text": text,
                          "finish_reason": out.finish_reason,
                          "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids)},
                          "timing_s": {"load": round(t1 - t0, 3), "generate": round(t2 - t1, 3)}}))
    else:
        print(text if text is not None else ",".join(map(str, out.token_ids)))
    return 0
