"""generate() against transformers' generate() on the same small config and weights.

Prefill tok/s (one forward over B prompts of P tokens) and decode tok/s (B x N new tokens over the
cache), ours and transformers' measured side by side in one run with the same thread count, printed
as ratios (ours / transformers). Greedy, eos ignored, so both do the same work.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from dist_glm5.backends import get_backend
from dist_glm5.train.hf import hf_copy

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded small model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="best of N")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def run(args: argparse.Namespace) -> int:
    from transformers import GlmMoeDsaForCausalLM

    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model()
    ours = load_model(model_dir, ops=get_backend("cpu").ops())
    with tempfile.TemporaryDirectory() as tmp:
        hf = GlmMoeDsaForCausalLM.from_pretrained(
            hf_copy(model_dir, Path(tmp)), dtype=ours.dtype
        ).eval()
    V, P, N = ours.cfg.vocab_size, args.prompt_len, args.new_tokens
    rows = []
    for B in args.batch:
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(0, V, (B, P), generator=g)
        prompts = ids.tolist()
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        full = SamplingParams(max_tokens=N, ignore_eos=True)
        # best() runs each lambda within this iteration, so closing over the loop's variables is
        # safe here (B023).
        with torch.no_grad():
            o_pre = best(lambda: generate(ours, prompts, one), args.repeats)  # noqa: B023
            o_all = best(lambda: generate(ours, prompts, full), args.repeats)  # noqa: B023
            h_pre = best(lambda: hf(ids, use_cache=True), args.repeats)  # noqa: B023
            h_all = best(
                lambda: hf.generate(
                    ids,  # noqa: B023
                    max_new_tokens=N,
                    min_new_tokens=N,
                    do_sample=False,
                ),
                args.repeats,
            )
        r = {
            "batch": B,
            "prompt_len": P,
            "new_tokens": N,
            "threads": args.threads,
            "ours_prefill_tok_s": B * P / o_pre,
            "hf_prefill_tok_s": B * P / h_pre,
            "ours_decode_tok_s": B * (N - 1) / max(o_all - o_pre, 1e-9),
            "hf_decode_tok_s": B * (N - 1) / max(h_all - h_pre, 1e-9),
        }
        r["prefill_ratio"] = r["ours_prefill_tok_s"] / r["hf_prefill_tok_s"]
        r["decode_ratio"] = r["ours_decode_tok_s"] / r["hf_decode_tok_s"]
        rows.append(r)
    print(
        f"generate() vs transformers, {args.threads} thread(s), prompt {P}, {N} new tokens (ratio "
        "= ours / transformers)"
    )
    print(
        f"{'batch':>5} {'prefill ours':>13} {'prefill hf':>11} {'ratio':>6} {'decode ours':>12} "
        f"{'decode hf':>10} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ours_prefill_tok_s']:>13.0f} {r['hf_prefill_tok_s']:>11.0f} "
            f"{r['prefill_ratio']:>6.2f} {r['ours_decode_tok_s']:>12.1f} "
            f"{r['hf_decode_tok_s']:>10.1f} {r['decode_ratio']:>6.2f}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))
    return 0
