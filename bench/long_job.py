"""`dist-glm5 bench long-job`: one long prompt through `launch batch`, as a user runs it, checked.

    dist-glm5 bench netns exec -- dist-glm5 --log-level INFO bench long-job --ctx 637k \\
        --stages 2 --address 10.213.7.1:6379 --host 10.213.7.1 --dir /tmp/long-job-637k
    dist-glm5 bench long-job --ctx 128k --stages 2 --compare-one-process ...   # exactness

What it measures (MEASURED unless said COMPUTED), in one run:
- the time to first token of a random prompt of `--ctx` - `--max-tokens` ids (seed 0, greedy),
  from the job's own record, against the indexer + attention compute bound (COMPUTED:
  bench/longctx.py's FLOP count over the fp32 GEMM rate measured here before and after the job at
  one thread per worker, times the stages, as bench longctx bounds its two-stage runs);
- each stage's peak RSS (the workers' VmHWM) against the planner's total for that stage
  (COMPUTED by `launch batch`'s own plan, planning/worker_memory.py), as a ratio;
- with `--compare-one-process`: the same job in one process (no Ray, every layer in one worker)
  and whether its token ids equal the pipeline's (the reference: same weights, same greedy path).
The job runs as a subprocess (`launch batch`), so its progress lines reach this console as they
would a user's; its result lines and a summary JSON are left in `--dir`.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from dist_glm5.engine.config import parse_ctx

log = logging.getLogger(__name__)
LAUNCH = "import sys; from dist_glm5.launch.cli import main; sys.exit(main(sys.argv[1:]))"
MIB = 1 << 20


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ctx",
        type=parse_ctx,
        default=parse_ctx("128k"),
        help="the job's context (128k, 637k): a prompt of ctx - max_tokens ids, run with --ctx",
    )
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated after the prompt")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--address", help="the Ray cluster (one stage per node); default: a local one")
    p.add_argument("--host", default="127.0.0.1", help="this node's address (as launch)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="prefill chunk (as launch)")
    p.add_argument("--dir", required=True, help="prompt, results and summary.json go here")
    p.add_argument(
        "--compare-one-process",
        action="store_true",
        help="also run the job in one process and compare token ids (the reference)",
    )
    p.add_argument("--step-timeout", type=float, default=900.0, help="passed to launch batch")
    p.set_defaults(func=run)


def write_prompt(path: Path, tokens: int, max_tokens: int) -> None:
    import torch

    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    job = {"id": f"random-{tokens}", "prompt_ids": ids, "max_tokens": max_tokens}
    path.write_text(json.dumps({**job, "ignore_eos": True}) + "\n")


def batch_argv(args: argparse.Namespace, prompts: Path, out: Path, stages: int) -> list[str]:
    argv = ["launch", "batch", "--input", str(prompts), "--output", str(out)]
    argv += ["--ctx", str(args.ctx), "--stages", str(stages)]
    argv += ["--chunk-tokens", str(args.chunk_tokens), "--step-timeout", str(args.step_timeout)]
    if stages > 1 and args.address:
        argv += ["--address", args.address, "--host", args.host]
    return argv


def run_batch(argv: list[str], level: str) -> tuple[dict, float]:
    """Run `launch batch` (its log on our stderr); its one result line and the wall time."""
    out = Path(argv[argv.index("--output") + 1])
    out.unlink(missing_ok=True)  # a fresh run, not a resume
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", LAUNCH, "--log-level", level, *argv])
    wall = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(f"launch batch exited {r.returncode}: {' '.join(argv)}")
    rec = json.loads(out.read_text().splitlines()[0])
    if "error" in rec:
        raise RuntimeError(f"the job failed: {rec['error']}")
    return rec, wall


def planned_mib(args: argparse.Namespace, argv: list[str]) -> dict[str, float]:
    """What `launch batch` planned for this job (the same function, the same flags)."""
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.launch.batch import cache_blocks_for, memory_plan
    from dist_glm5.launch.batch import register as batch_flags
    from dist_glm5.model.config import ModelConfig

    p = argparse.ArgumentParser()
    batch_flags(p)
    b = p.parse_args(argv[2:])
    cfg = ModelConfig.from_hf(ensure_default_model())
    plan = memory_plan(b, cfg, b.ctx, cache_blocks_for(b, b.ctx))
    return {str(s): m.total / MIB for s, _, m in plan.stages}


def run(args: argparse.Namespace) -> int:
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.model.config import ModelConfig

    from .longctx import gemm_rate, prefill_flops

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    prompts = d / "prompt.jsonl"
    tokens = args.ctx - args.max_tokens
    if tokens < 1:
        raise ValueError(f"--ctx {args.ctx} leaves no prompt after --max-tokens {args.max_tokens}")
    write_prompt(prompts, tokens, args.max_tokens)
    cfg = ModelConfig.from_hf(ensure_default_model())
    # one thread per worker: with --address, launch gives each worker its node's cores (1 CPU
    # per netns node); the rate is measured before and after the job, the faster one kept (a
    # tighter bound)
    rates = [gemm_rate(1)]
    argv = batch_argv(args, prompts, d / f"results-{args.stages}-stages.jsonl", args.stages)
    log.info("running: launch %s", " ".join(argv[1:]))
    rec, wall = run_batch(argv, level)
    rates.append(gemm_rate(1))
    rate = max(rates)
    f = prefill_flops(cfg, tokens)
    bound = (f["indexer"] + f["attention"]) / (rate * args.stages)
    t = rec["timing"]
    plan = planned_mib(args, argv)
    res = {
        "ctx": args.ctx,
        "prompt_tokens": tokens,
        "stages": args.stages,
        "address": args.address,
        "gemm_gflops_1_thread": [r / 1e9 for r in rates],
        "flops": f,
        "bound_s": bound,
        "ttft_s": t["ttft_s"],
        "ttft_over_bound": t["ttft_s"] / bound,
        "prefill_tok_s": t["prefill_tok_s"],
        "wall_s": wall,
        "peak_rss_mib": t["peak_rss_mib"],
        "planned_mib": plan,
        "rss_over_plan": {s: v / plan[s] for s, v in t["peak_rss_mib"].items() if s in plan},
        "token_ids": rec["token_ids"],
    }
    if args.compare_one_process:
        one = batch_argv(args, prompts, d / "results-1-process.jsonl", 1)
        log.info("running the reference: launch %s", " ".join(one[1:]))
        ref, ref_wall = run_batch(one, level)
        res["one_process"] = {
            "token_ids": ref["token_ids"],
            "ttft_s": ref["timing"]["ttft_s"],
            "wall_s": ref_wall,
        }
        res["equal"] = ref["token_ids"] == rec["token_ids"]
    (d / "summary.json").write_text(json.dumps(res, indent=1))
    print(f"{tokens} tokens through {args.stages} stage(s) ({args.address or 'local Ray'})")
    print(
        f"  time to first token {t['ttft_s']:.1f} s (measured) vs indexer + attention bound "
        f"{bound:.1f} s (computed at {rate / 1e9:.1f} GFLOP/s per thread, measured) -> "
        f"{t['ttft_s'] / bound:.2f}x; prefill {t['prefill_tok_s']:.0f} tokens/s"
    )
    for s, v in t["peak_rss_mib"].items():
        print(
            f"  stage {s}: peak RSS {v:.0f} MiB (measured), plan {plan[s]:.0f} MiB (computed) "
            f"-> {v / plan[s]:.2f}x"
        )
    print(f"  tokens {rec['token_ids']}")
    if args.compare_one_process:
        same = "equal" if res["equal"] else "DIFFER"
        print(f"  one process: tokens {res['one_process']['token_ids']} -> {same}")
        return 0 if res["equal"] else 1
    return 0
