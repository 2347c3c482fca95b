"""Long context on the embedded model, sparse DSA, MEASURED side by side in one run
(`bench longctx`); each measurement in a fresh process (clean peak RSS).

- Time to first token at each context, one stage (in-process engine) and two stages (Ray), against
  the COMPUTED compute bound of its indexer and attention FLOPs at the GEMM rate measured here at
  the same thread count (fp32 torch.mm). Goal: within 3x of the bound.
- Decode ms/token at each context, batch 1 and 8 (the cache filled with synthetic rows: decode
  work does not depend on the values), with exact and with int8 index keys (`--index-keys`), on
  the embedded model or `--model`. Goal: t(32K) / t(4K) <= 1.2. Beside each ratio, floors the
  first step plus the extra index keys cannot beat: read at the measured bandwidth, and (int8
  keys on AVX-512 VNNI) scanned at the measured vpdpbusd rate of a core times the threads.
  `int8-vnni`: int8 keys with the kernel's AMX path off, beside `int8` (AMX where the CPU has it).
- Peak RSS per worker against the planner's prediction (planning/worker_memory.py) for the same
  run: weights + cache + workspaces.
- The k-th largest score per row: bisection (Gaudi's method) against torch.topk (the CPU's).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from dist_glm5.planning.worker_memory import RUNTIME_BYTES

log = logging.getLogger(__name__)

CHUNK = 1024  # prefill chunk tokens in the TTFT runs
RUNTIME_MB = RUNTIME_BYTES["cpu"] / 1e6  # the planner's fixed allowance, left out: RSS has it

_TTFT = r"""
import json, sys, time, torch
from dist_glm5.obs.peak_rss import peak_rss_mb
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.checkpoint.tokenizer import load_tokenizer
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout, StageSpec
from dist_glm5.engine.scheduler import SchedulerConfig
ctx, stages, threads, chunk = map(int, sys.argv[1:5])
d = ensure_default_model()
cfg = ModelConfig.from_hf(d)
blocks = ctx // 64 + 4
eng = EngineConfig(str(d), Layout(stages), CacheConfig(blocks),
                   SchedulerConfig(chunk_tokens=chunk, max_model_len=blocks * 64),
                   DSAConfig(mode="sparse"), threads=threads)
if stages == 1:
    from dist_glm5.stages.inprocess_pipeline import InProcessPipeline
    torch.set_num_threads(threads)
    pipe = InProcessPipeline(StageSpec(eng))
else:
    from dist_glm5.stages.ray_pipeline import RayPipeline
    pipe = RayPipeline(eng)
c = Coordinator(pipe, eng.scheduler, cfg.eos_token_id, cfg.vocab_size, step_timeout=7200)
prompt = torch.randint(0, 256, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
try:
    t = time.perf_counter()
    s = c.run([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    ttft = time.perf_counter() - t
    assert s.finish_reason == "length", s.error
    rss = {0: peak_rss_mb()} if stages == 1 else {
        0: max(x.peak_rss_mb for x in pipe.timings), stages - 1: c.stats.peak_rss_mb}
finally:
    c.close()
print(json.dumps({"ttft_s": ttft, "peak_rss_mb": rss}))
"""

_DECODE = r"""
import json, sys, time, torch
from dist_glm5.obs.peak_rss import peak_rss_mb
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.backends import get_backend
from dist_glm5.quant import index_q8
ctx, batch, steps, threads, warmup = map(int, sys.argv[1:6])
keys, model = sys.argv[6], sys.argv[7] or ensure_default_model()
torch.set_num_threads(threads)
if keys == "int8-vnni":  # int8 keys with the AMX path off (the A/B where the CPU has AMX)
    from dist_glm5.kernels import dsa_select
    keys = "int8"
    dsa_select.force_no_amx(True)
m = load_model(model, mtp=False, ops=get_backend("cpu").ops(),
               dsa=DSAConfig(mode="sparse", index_keys=keys))
per = ctx // 64 + 2
cache = m.new_cache(per * batch, 64)
g = torch.Generator().manual_seed(0)
cache.prepare([Chunk(i, 0, ctx) for i in range(batch)])
for store in cache.kv.values():
    store.normal_(generator=g)
for store in cache.index_k.values():
    if index_q8.is_store(store):
        store.copy_(index_q8.pack(torch.randn(store.shape[0], store.shape[1] - 4, generator=g)))
    else:
        store.normal_(generator=g)
times = []
with torch.no_grad():
    for i in range(warmup + steps):  # the first steps fault in scratch and warm caches: untimed
        t = time.perf_counter()
        b = cache.prepare([Chunk(j, ctx + i, 1) for j in range(batch)])
        h, _ = m(torch.tensor([i % 256] * batch), b, cache)
        m.logits(m.final_norm(h))
        if i >= warmup:
            times.append(time.perf_counter() - t)
# the index keys a position adds to what each step reads (every full indexer's cache row)
key_bytes = sum(s.shape[1] * s.element_size() for s in cache.index_k.values())
print(json.dumps({"ms_per_step": 1e3 * sorted(times)[len(times) // 2],
                  "peak_rss_mb": peak_rss_mb(), "index_key_bytes_per_position": key_bytes}))
"""


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttft-contexts", type=int, nargs="*", default=[4096, 16384, 65536])
    p.add_argument("--ttft-stages", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--decode-contexts", type=int, nargs="*", default=[4096, 16384, 32768, 65536, 131072]
    )
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--index-keys",
        nargs="+",
        choices=["exact", "int8", "int8-vnni"],
        default=["exact", "int8"],
        help="decode with these index keys, side by side (int8-vnni: int8 with the kernel's AMX "
        "path off, where the CPU has AMX)",
    )
    p.add_argument("--model", default="", help="decode on this checkpoint (default: embedded)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one stage, and decode)")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps (the median)")
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed decode steps first (a context's first steps fault in the scratch: with "
        "them in the median, 12 steps read 1.55x at 32K where 64 read 1.16x)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="decode: measure every context this many times, interleaved, and take the median",
    )
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def sub(code: str, *args) -> dict | None:
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True
    )
    if r.returncode:
        tail = r.stderr.strip().splitlines()[-3:] if r.stderr else r.returncode
        log.warning("measurement %s failed: %s", args, tail)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def gemm_rate(threads: int) -> float:
    """fp32 FLOP/s of torch.mm at this thread count (best of 5, 1024^3)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(before)
    return 2 * 1024**3 / best


def prefill_flops(cfg, T: int) -> dict[str, float]:
    """Indexer and attention FLOPs of prefilling T tokens (COMPUTED): every query scores every
    earlier key in each full-indexer layer; each query attends over min(t + 1, topk) keys in
    every layer (absorbed MLA: scores over latent + rope dims, output over the latent)."""
    full = sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    pairs = T * (T + 1) / 2  # (query, earlier key) pairs
    Hi, D = cfg.index_n_heads, cfg.index_head_dim
    indexer = full * pairs * Hi * (2 * D + 2)
    kept = sum(min(t + 1, cfg.index_topk) for t in range(0, T, 64)) * 64
    h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attention = cfg.num_hidden_layers * kept * h * (2 * (c + r) + 2 * c)
    return {"indexer": indexer, "attention": attention}


def planned_mb(cfg, context: int, stages: int) -> dict[int, float]:
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.planning.partition import partition_layers
    from dist_glm5.planning.worker_memory import worker_memory

    ranges = partition_layers(cfg, stages)
    # the plan without its fixed runtime allowance (torch, allocator: measured in the RSS too)
    return {
        s: worker_memory(
            cfg,
            ranges[s],
            s == 0,
            s == stages - 1,
            mtp=False,
            cache_tokens=(context // 64 + 4) * 64,
            chunk_tokens=CHUNK,
            context=context,
            dtype_bytes=2 if cfg.torch_dtype == "bfloat16" else 4,
            dsa=DSAConfig(mode="sparse"),
        ).total
        / 1e6
        - RUNTIME_MB
        for s in range(stages)
    }


def _scan_floor(args: argparse.Namespace) -> tuple[float, set, float]:
    """(the vpdpbusd rate of a core, the index-key kinds it bounds, vpdpbusd per position): int8
    keys' scan floor, Hi * D / 64 vpdpbusd a key-row and full indexer. Rows the AMX path scores
    have none (rate 0 when no row is on VNNI)."""
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.kernels import dsa_select
    from dist_glm5.model.config import ModelConfig

    dcfg = ModelConfig.from_hf(args.model or ensure_default_model())
    full = sum(dcfg.has_indexer(i) for i in range(dcfg.num_hidden_layers))
    per_pos = full * dcfg.index_n_heads * dcfg.index_head_dim / 64
    amx = dsa_select.uses_amx(dcfg.index_head_dim, dcfg.index_n_heads)
    on_vnni = {k for k in args.index_keys if k == "int8-vnni" or (k == "int8" and not amx)}
    vnni = dsa_select.vnni_rate() if on_vnni and dsa_select.uses_vnni(dcfg.index_head_dim) else 0.0
    if amx and "int8" in args.index_keys:
        print("  int8 rows: scored with AMX (tdpbssd); int8-vnni rows: the same with AMX off")
    if vnni:
        print(
            f"  {', '.join(sorted(on_vnni))} rows: scan floor = the first step + {per_pos:.0f} "
            f"vpdpbusd per extra position at {vnni / 1e9:.1f} G/s a core (measured) x "
            f"{args.threads}"
        )
    return vnni, on_vnni, per_pos


def decode_rows(args: argparse.Namespace, res: dict) -> None:
    """The decode rows: each context and batch in a fresh process, with its floors."""
    from dist_glm5.obs.bandwidth import read_bandwidth

    if not args.decode_contexts:
        return
    bw = read_bandwidth(args.threads)  # about a second: only when decode is measured
    print(
        f"decode ms per step, {args.threads} thread(s), synthetic cache, "
        f"{args.model or 'embedded'}; floor = the first context's step + the extra index "
        f"keys read at {bw / 1e9:.1f} GB/s (measured)"
    )
    vnni, on_vnni, vnni_per_pos = _scan_floor(args)
    base: dict[tuple, float] = {}
    for B in args.decode_batches:
        for keys in args.index_keys:
            # the contexts interleaved, round after round: this VM's speed drifts by the minute
            runs: dict[int, list] = {T: [] for T in args.decode_contexts}
            for _ in range(args.rounds):
                for T in args.decode_contexts:
                    runs[T].append(
                        sub(_DECODE, T, B, args.steps, args.threads, args.warmup, keys, args.model)
                    )
            for T in args.decode_contexts:
                ok = sorted((x for x in runs[T] if x is not None), key=lambda x: x["ms_per_step"])
                r = None  # any failed round fails the row
                if len(ok) == len(runs[T]):
                    r = {**ok[len(ok) // 2], "rounds_ms": [x["ms_per_step"] for x in runs[T]]}
                res["decode"].append({"context": T, "batch": B, "index_keys": keys, **(r or {})})
                if r is None:
                    print(f"  batch {B}, {keys} keys, at {T:>7}: failed")
                    continue
                ms = r["ms_per_step"]  # the median round's
                first = base.setdefault((B, keys), ms)
                T0 = args.decode_contexts[0]
                extra = B * (T - T0) * r["index_key_bytes_per_position"]
                floor = (first + 1e3 * extra / bw) / first  # keys alone, at the read rate
                res["decode"][-1]["floor_ratio"] = floor
                scan = ""
                if keys in on_vnni and vnni:
                    sf = (first + 1e3 * B * (T - T0) * vnni_per_pos / (vnni * args.threads)) / first
                    res["decode"][-1]["scan_floor_ratio"] = sf
                    scan = f", scan floor {sf:.2f}x"
                spread = ""
                if args.rounds > 1:
                    spread = " (rounds " + ", ".join(f"{x:.2f}" for x in r["rounds_ms"]) + ")"
                print(
                    f"  batch {B}, {keys:>5} keys, at {T:>7}: {ms:7.2f} ms{spread} "
                    f"({ms / first:.2f}x of {T0}, floor {floor:.2f}x{scan}; goal at 32K <= 1.2), "
                    f"peak RSS {r['peak_rss_mb']:.0f} MB"
                )


def run(args: argparse.Namespace) -> int:
    import torch

    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.ops.topk import kth_largest_bisect

    cfg = ModelConfig.from_hf(ensure_default_model())
    rate = {nt: gemm_rate(nt) for nt in {args.threads, 1}}
    res: dict = {"gemm_gflops": {k: v / 1e9 for k, v in rate.items()}, "ttft": [], "decode": []}
    print(
        "GEMM rate (fp32 torch.mm 1024^3, measured): "
        + ", ".join(f"{nt} thread(s) {r / 1e9:.0f} GFLOP/s" for nt, r in rate.items())
    )
    print(f"time to first token (chunks of {CHUNK}); bound = indexer + attention FLOPs / rate")
    for T in args.ttft_contexts:
        f = prefill_flops(cfg, T)
        for st in args.ttft_stages:
            # two stages: one thread per worker on this 2-core machine; the bound uses the
            # combined rate of the cores both stages use
            nt = args.threads if st == 1 else 1
            bound = (f["indexer"] + f["attention"]) / (rate[nt] * (1 if st == 1 else st))
            r = sub(_TTFT, T, st, nt, CHUNK)
            row = {
                "context": T,
                "stages": st,
                "threads_per_worker": nt,
                "bound_s": bound,
                "flops": f,
                "planned_mb": planned_mb(cfg, T, st),
                **(r or {}),
            }
            res["ttft"].append(row)
            if r is None:
                print(f"  {T:>7} x {st} stage(s): failed")
                continue
            rss = ", ".join(
                f"stage {s} {row['peak_rss_mb'][s]:.0f} MB (plan {row['planned_mb'][int(s)]:.0f} + "
                "runtime)"
                for s in row["peak_rss_mb"]
            )
            print(
                f"  {T:>7} x {st} stage(s): {r['ttft_s']:8.1f} s, bound {bound:7.1f} s -> "
                f"{r['ttft_s'] / bound:.1f}x (goal <= 3); peak RSS {rss}"
            )
    decode_rows(args, res)
    print("k-th largest score per row: bisection vs torch.topk (same rows, 1 thread)")
    torch.set_num_threads(1)
    res["topk"] = []
    for rows, L, k in ((1, 65536, 2048), (64, 65536, 2048), (256, 16384, 2048)):
        s = torch.randn(rows, L)
        t = time.perf_counter()
        a = kth_largest_bisect(s, k)
        tb = time.perf_counter() - t
        t = time.perf_counter()
        b = s.topk(k).values[:, -1]
        tt = time.perf_counter() - t
        assert torch.equal(a, b)
        res["topk"].append(
            {"rows": rows, "L": L, "k": k, "bisect_ms": tb * 1e3, "topk_ms": tt * 1e3}
        )
        print(
            f"  {rows:>4} x {L:>6}, k={k}: bisection {tb * 1e3:8.2f} ms, torch.topk "
            f"{tt * 1e3:8.2f} ms (ratio {tb / tt:.1f})"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))
    return 0
