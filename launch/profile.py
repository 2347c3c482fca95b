"""`launch profile`: the anatomy of decode steps and prefill chunks, per stage and rank.

Runs a workload (batch x prompt length, then decode steps, MTP on or off) with the profiler on in
every worker, then prints per stage, e.g.
    stage 0: 12.3 ms decode step = experts 4.1 (slowest rank; mean 3.9) + attention 2.0 + ...
With --output DIR it writes trace.json (Chrome/Perfetto trace events), anatomy.json and a PNG
timeline per stage (timeline-stage-S.png).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dist_glm5.engine.scheduler import StepKind
from dist_glm5.obs.profiler import exclusive_times

from .engine_args import add_layout_args, build_engine, engine_config, model_dir

log = logging.getLogger(__name__)
PARTS = [
    "experts",
    "attention",
    "indexer",
    "moe_outside",
    "mlp",
    "all_reduce",
    "transfer",
    "sampler",
    "draft",
    "host",
    "bubble",
]


def register(p: argparse.ArgumentParser) -> None:
    add_layout_args(p)
    p.add_argument("--ctx", type=int, default=512, help="prompt length")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=12)
    # the sparse path is the default now (--dsa dense for the reference); kept for old scripts
    p.add_argument("--sparse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--output", help="directory for trace.json, anatomy.json and timeline PNGs")
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        help="memory bandwidth per worker for the roofline bound (GB/s; default: measured here "
        "at the workers' thread count, torch sum over 1 GiB)",
    )
    p.set_defaults(func=run)


def anatomy(events_by: dict[tuple[int, int, int], list], kinds: dict[int, str], kind: str) -> dict:
    """Mean exclusive ms per part per stage over steps of `kind`; experts also per rank (slowest,
    mean)."""
    stages = sorted({s for _, s, _ in events_by})
    out = {}
    for s in stages:
        steps = sorted({st for st, ss, _ in events_by if ss == s and kinds.get(st) == kind})
        if not steps:
            continue
        ranks = sorted({r for _, ss, r in events_by if ss == s})
        acc = {p: 0.0 for p in PARTS} | {
            "step": 0.0,
            "experts_slowest": 0.0,
            "experts_mean": 0.0,
            "draft_inclusive": 0.0,
        }
        for st in steps:
            ex = {r: exclusive_times(events_by.get((st, s, r), [])) for r in ranks}
            e0 = ex[ranks[0]]
            step_ms = 1e3 * sum(
                d
                for n, _, d, dep in events_by.get((st, s, ranks[0]), [])
                if n == "step" and dep == 0
            )
            acc["step"] += step_ms
            acc["draft_inclusive"] += 1e3 * sum(
                d for n, _, d, _ in events_by.get((st, s, ranks[0]), []) if n == "draft"
            )
            parts = {
                "experts": e0.get("experts", 0),
                "attention": e0.get("attention", 0),
                "indexer": e0.get("indexer", 0),
                "moe_outside": e0.get("router", 0) + e0.get("shared", 0) + e0.get("moe", 0),
                "mlp": e0.get("mlp", 0),
                "all_reduce": e0.get("all_reduce", 0),
                "transfer": e0.get("transfer", 0),
                "sampler": e0.get("sampler", 0),
                "draft": e0.get("draft", 0),  # its layer's spans are in the parts above
                "host": e0.get("step", 0),
                "bubble": e0.get("recv_wait", 0),
            }
            for k, v in parts.items():
                acc[k] += 1e3 * v
            per_rank = [1e3 * ex[r].get("experts", 0) for r in ranks]
            acc["experts_slowest"] += max(per_rank)
            acc["experts_mean"] += sum(per_rank) / len(per_rank)
        out[s] = {k: v / len(steps) for k, v in acc.items()} | {
            "steps": len(steps),
            "ranks": len(ranks),
        }
    return out


def describe(a: dict, kind: str) -> list[str]:
    lines = []
    for s, r in a.items():
        parts = [f"experts {r['experts_slowest']:.2f} (slowest rank; mean {r['experts_mean']:.2f})"]
        parts += [f"{p.replace('_', ' ')} {r[p]:.2f}" for p in PARTS[1:] if r[p] >= 0.005]
        lines.append(f"stage {s}: {r['step']:.2f} ms {kind} step = " + " + ".join(parts))
        if r["draft_inclusive"] >= 0.005:
            lines.append(
                f"stage {s}: of which the MTP draft (its layer, logits and proposal; the layer's "
                f"attention and experts are counted in those parts) {r['draft_inclusive']:.2f} ms"
            )
    return lines


def chrome_trace(events_by: dict, kinds: dict) -> dict:
    t0 = min((e[1] for evs in events_by.values() for e in evs), default=0.0)
    out = []
    for (step, stage, rank), evs in events_by.items():
        for name, start, dur, depth in evs:
            out.append(
                {
                    "name": name,
                    "cat": kinds.get(step, "step"),
                    "ph": "X",
                    "ts": (start - t0) * 1e6,
                    "dur": dur * 1e6,
                    "pid": stage,
                    "tid": rank,
                    "args": {"step": step, "depth": depth},
                }
            )
    meta = [
        {"name": "process_name", "ph": "M", "pid": s, "args": {"name": f"stage {s}"}}
        for s in sorted({k[1] for k in events_by})
    ]
    return {"traceEvents": meta + sorted(out, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}


def run_threads(args) -> int:
    """Torch threads per worker in this run (the worker keeps torch's default unless told)."""
    import torch

    return args.threads or torch.get_num_threads()


def roofline_fraction(d, args, decode: dict, bandwidth_gbs: float) -> dict:
    """Measured decode step time against the bandwidth bound for the same model and workload
    (planning/roofline.py, computed)."""
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.planning.roofline import HBM, decode_bytes

    cfg = ModelConfig.from_hf(d)
    dtype = args.dtype or cfg.torch_dtype
    wb = 4 if dtype == "float32" else 2
    hw = HBM("this machine", bandwidth_gbs * 1e9, max(args.tp, args.ep))
    rows = decode_bytes(
        cfg,
        args.stages,
        args.ctx + args.decode_steps // 2,
        args.batch,
        2 if args.mtp else 1,
        hw,
        expert_bytes=0.53125 if cfg.experts_format == "mxfp4" else wb,
        weight_bytes=wb,
        idx_bytes=cfg.index_head_dim * wb,
        mla_bytes=cfg.kv_cache_dim * wb,
    )
    out = {}
    for r in rows:
        if str(r.stage) in decode or r.stage in decode:
            a = decode.get(r.stage) or decode.get(str(r.stage))
            m, bound = a["step"], 1e3 * r.total / hw.bandwidth
            # the step without its routed experts (the slowest rank's) against the bytes the
            # rest reads: what the experts kernel does not explain
            rest_bytes = r.total - r.expert_weights
            rest_ms, rest_bound = m - a.get("experts_slowest", 0.0), 1e3 * rest_bytes / hw.bandwidth
            out[r.stage] = {
                "measured_ms": m,
                "bound_ms": bound,
                "bytes": r.total,
                "fraction": m / bound,
                "non_expert_ms": rest_ms,
                "non_expert_bound_ms": rest_bound,
                "non_expert_bytes": rest_bytes,
                "non_expert_fraction": rest_ms / rest_bound,
            }
    return out


def output_tokens(args: argparse.Namespace) -> int:
    """Tokens each sequence is asked for: --decode-steps once every prompt is in. The first
    sequences decode while the later prompts prefill (a token a step at most), so they are asked
    for that many more: else they finish before the batch is whole."""
    prefill_steps = args.batch * -(-args.ctx // args.chunk_tokens) if args.batch > 1 else 0
    return args.decode_steps + 1 + prefill_steps


def workload_blocks(args: argparse.Namespace) -> int:
    """Cache blocks that hold the whole batch at once (every prompt, its output and an MTP
    draft's row): with fewer, sequences wait for others' blocks and the decode steps measured
    are smaller than the batch asked for."""
    per_seq = -(-(args.ctx + output_tokens(args) + 1) // args.block_size)
    return args.batch * per_seq


def whole_batch_kinds(steps: dict[int, StepKind], batch: int) -> dict[int, str]:
    """The steps' kinds (the scheduler's StepKind), a decode of fewer than `batch` sequences
    (the first to finish leave early) named "decode-partial", so the decode anatomy is the batch
    asked for."""
    return {
        st: "decode-partial" if s.kind == "decode" and s.rows < batch else s.kind
        for st, s in steps.items()
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from dist_glm5.sampling.params import SamplingParams

    d = model_dir(args)
    blocks = max(args.cache_blocks, workload_blocks(args))
    engine = build_engine(engine_config(args, d, profile=True, cache_blocks=blocks))
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, 256, (args.ctx,), generator=g).tolist() for _ in range(args.batch)
        ]
        engine.run(prompts, SamplingParams(max_tokens=output_tokens(args), ignore_eos=True))
    finally:
        engine.close()
    events_by = engine.step_events
    # a step carries one micro-batch: the batch split over those in flight
    per_step = -(-args.batch // (args.microbatches or args.stages))
    kinds = whole_batch_kinds(engine.scheduler.steps, per_step)
    whole = sum(k == "decode" for k in kinds.values())
    if not whole:
        raise SystemExit(
            f"no decode step ran {per_step} sequences together, so there is no decode step of "
            "that batch to show: raise --decode-steps or --cache-blocks"
        )
    log.info(
        "decode anatomy over %d steps of %d sequences (%d smaller decode steps left out)",
        whole,
        per_step,
        sum(k == "decode-partial" for k in kinds.values()),
    )
    result = {
        "workload": {
            "ctx": args.ctx,
            "batch": args.batch,
            "decode_steps": args.decode_steps,
            "mtp": args.mtp,
            "stages": args.stages,
            "tp": args.tp,
            "ep": args.ep,
        },
        "decode": anatomy(events_by, kinds, "decode"),
        "prefill": anatomy(events_by, kinds, "prefill"),
    }
    for kind in ("decode", "prefill"):
        for line in describe(result[kind], kind):
            print(line)
    if args.bandwidth_gbs:
        bw, how = args.bandwidth_gbs, "given"
    else:  # measured after the run: the workers' memory is free again
        from dist_glm5.obs.bandwidth import read_bandwidth

        bw = read_bandwidth(run_threads(args)) / 1e9
        how = f"measured at {run_threads(args)} thread(s)"
    result["bandwidth_gb_s"] = bw
    result["roofline"] = roofline_fraction(d, args, result["decode"], bw)
    for s, r in result["roofline"].items():
        print(
            f"stage {s}: decode step {r['measured_ms']:.2f} ms = {r['fraction']:.1f}x the "
            f"roofline bound {r['bound_ms']:.3f} ms ({r['bytes'] / 1e6:.1f} MB per step at "
            f"{bw:.1f} GB/s {how}; computed)"
        )
        print(
            f"stage {s}: without the routed experts {r['non_expert_ms']:.2f} ms = "
            f"{r['non_expert_fraction']:.1f}x its bound {r['non_expert_bound_ms']:.3f} ms "
            f"({r['non_expert_bytes'] / 1e6:.1f} MB: attention, dense and shared weights, "
            "indexer keys, MLA rows, lm_head)"
        )
    if args.output:
        from .timeline_plot import plot_timeline  # matplotlib: imported only when drawing

        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trace.json").write_text(json.dumps(chrome_trace(events_by, kinds)))
        (out / "anatomy.json").write_text(json.dumps(result, indent=1))
        decode_steps = sorted(st for st, k in kinds.items() if k == "decode")[-3:]
        layout = f"{args.stages} stage{'s' * (args.stages > 1)} x TP {args.tp} x EP {args.ep}"
        for s in sorted({k[1] for k in events_by}):
            spans: dict[tuple[int, int], list] = {}
            for (st, ss, r), evs in sorted(events_by.items()):
                if ss == s and st in decode_steps:
                    spans.setdefault((s, r), []).extend(evs)
            plot_timeline(
                out / f"timeline-stage-{s}.png",
                spans,
                f"{layout}, stage {s}: batch {args.batch}, context {args.ctx}, last "
                f"{len(decode_steps)} of {args.decode_steps} decode steps"
                f"{', MTP' if args.mtp else ''}",
            )
        print(
            f"wrote {out}/trace.json (open in chrome://tracing or ui.perfetto.dev), "
            "anatomy.json, timeline-stage-*.png"
        )
    return 0
