"""Pipeline benchmarks on a local two-node Ray cluster, all in one run:

- per-stage utilisation (busy / wall) at steady decode with 1, 2 and 4 micro-batches in flight;
- two-stage against one-stage decode throughput (same micro-batches);
- MTP: decode tokens per step and draft acceptance;
- the stage-to-stage transfer: bytes and seconds per token.
The embedded model on CPU; every worker is one process with one torch thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded small model)")
    p.add_argument("--batch", type=int, default=8, help="concurrent sequences")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def measure(d: str, stages: int, microbatches: int, mtp: bool, prompts, new_tokens: int) -> dict:
    from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout
    from dist_glm5.engine.coordinator import Coordinator
    from dist_glm5.engine.scheduler import SchedulerConfig
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.sampling.params import SamplingParams
    from dist_glm5.stages.ray_pipeline import RayPipeline

    cfg = ModelConfig.from_hf(d)
    engine = EngineConfig(
        d,
        Layout(stages),
        CacheConfig(64),
        SchedulerConfig(microbatches=microbatches, chunk_tokens=512),
        mtp=mtp,
    )
    pipe = RayPipeline(engine)
    c = Coordinator(pipe, engine.scheduler, cfg.eos_token_id, cfg.vocab_size)
    try:
        c.run(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up every worker
        pipe.timings.clear()
        c.stats.stage_busy.clear()
        steps0 = c.stats.steps
        t0 = time.perf_counter()
        seqs = c.run(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        wall = time.perf_counter() - t0
    finally:
        c.close()
    busy = {f"stage {stages - 1}": sum(c.stats.stage_busy.values())}
    for t in pipe.timings:
        busy[f"stage {t.stage}"] = busy.get(f"stage {t.stage}", 0.0) + t.busy_s
    tokens = sum(len(s.output) for s in seqs)
    decode_steps = sum(s.steps - 1 for s in seqs)
    sent = sum(t.sent_bytes for t in pipe.timings)
    hidden_rows = sent / (cfg.hidden_size * 4) if sent else 0
    return {
        "stages": stages,
        "microbatches": microbatches,
        "mtp": mtp,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "steps": c.stats.steps - steps0,
        "utilisation": {k: v / wall for k, v in sorted(busy.items())},
        "decode_tokens_per_step": sum(len(s.output) - 1 for s in seqs) / max(decode_steps, 1),
        "acceptance": c.stats.acceptance,
        "transfer_bytes_per_token": sent / hidden_rows if hidden_rows else None,
        "transfer_us_per_token": 1e6 * sum(t.send_s for t in pipe.timings) / hidden_rows
        if hidden_rows
        else None,
    }


def run(args: argparse.Namespace) -> int:
    import ray
    import torch

    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.stages.ray_pipeline import local_cluster

    d = str(Path(args.model) if args.model else ensure_default_model())
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    cluster = local_cluster(2, cpus_per_node=4)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for stages in (1, 2):
            for mb in args.microbatches:
                rows.append(measure(d, stages, mb, False, prompts, args.new_tokens))
        rows.append(measure(d, 2, 2, True, prompts, args.new_tokens))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(
        f"pipeline on a local 2-node Ray cluster (this machine: {torch.get_num_threads()} "
        f"threads), batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens"
    )
    print(
        f"{'stages':>6} {'mb':>3} {'mtp':>4} {'tok/s':>7} "
        f"{'utilisation (busy/wall) per stage':>40} {'tok/step':>9}"
    )
    for r in rows:
        util = ", ".join(f"{k} {v:.0%}" for k, v in r["utilisation"].items())
        print(
            f"{r['stages']:>6} {r['microbatches']:>3} {str(r['mtp']):>4} {r['tokens_per_s']:>7.1f} "
            f"{util:>40} {r['decode_tokens_per_step']:>9.2f}"
        )
    one = {r["microbatches"]: r for r in rows if r["stages"] == 1 and not r["mtp"]}
    two = {r["microbatches"]: r for r in rows if r["stages"] == 2 and not r["mtp"]}
    for mb in sorted(set(one) & set(two)):
        print(
            f"two-stage / one-stage throughput, {mb} micro-batch(es): "
            f"{two[mb]['tokens_per_s'] / one[mb]['tokens_per_s']:.2f}"
        )
    mtp = next(r for r in rows if r["mtp"])
    print(
        f"MTP (2 stages): {mtp['decode_tokens_per_step']:.2f} decode tokens/step, acceptance "
        f"{mtp['acceptance']}"
    )
    t = next(r for r in rows if r["transfer_us_per_token"])
    print(
        f"stage-to-stage transfer: {t['transfer_bytes_per_token']:.0f} B and "
        f"{t['transfer_us_per_token']:.1f} us per token (gloo send, loopback)"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))
    return 0
