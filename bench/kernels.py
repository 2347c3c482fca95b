"""The packed MXFP4 MoE kernel against dequantise-then-GEMM, and against the machine's read
bandwidth, MEASURED side by side in one run.

For each model's expert shapes (GLM-5: hidden 6144, moe_intermediate 2048, top-8; the small
model: 1024, 512, top-8) and each thread count:
- decode batches (1, 4, 16, 64 tokens): the kernel's time, its GB/s of packed bytes read (w13,
  w2 and their scales of the experts the batch touches), that as a fraction of the read bandwidth
  measured in the same run (torch sum over a 1 GiB fp32 tensor, best of 5), and the speed-up
  over the reference path (decode each touched expert to fp32 with the project's codec, then
  F.linear);
- prefill batches (128, 512 tokens): the kernel with its default GEMM threshold, the fused kernel
  alone, and the reference path;
- a sweep of the tokens routed to ONE expert: fused kernel vs decode + GEMM, which is how
  GEMM_MIN_ROUTES in kernels/mxfp4_moe.py was chosen.
Only the experts that routing can touch are allocated (GLM-5: 64 of 256, ids drawn from them),
so memory stays near 1.3 GB. Goals: >= 60% of the read bandwidth at batch 1, >= 3x the
reference at batches 1-16.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MODELS = {  # name: (hidden, moe_intermediate, experts allocated, top-k)
    "glm5": (6144, 2048, 64, 8),
    "small": (1024, 512, 64, 8),
}


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 512])
    p.add_argument("--prefill-models", nargs="+", default=["small"], choices=list(MODELS),
                   help="prefill on GLM-5 shapes takes ~10 s per point; add glm5 to measure it")
    p.add_argument("--sweep", type=int, nargs="*", default=[8, 16, 32, 64, 128],
                   help="tokens routed to one expert, fused vs decode + GEMM (none: skip)")
    p.add_argument("--isa", choices=["scalar", "avx2", "avx512"], help="force the kernel's path")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of repeats per point")
    p.add_argument("--json", help="write all figures here")
    p.set_defaults(func=run)


def best_time(fn, budget: float, max_reps: int = 50) -> float:
    """Best wall time of repeated calls: at least 2 (the first warms up) unless a call alone
    exceeds the budget, then until `budget` seconds are spent."""
    times: list[float] = []
    while not times or (sum(times) < budget and len(times) < max_reps) or (
            len(times) < 2 and times[0] < budget):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(threads: int) -> float:
    """Bytes/s of torch.sum over a 1 GiB fp32 tensor, best of 5."""
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def make_experts(E: int, H: int, I: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 128, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 128, (E, H, I // 32), dtype=torch.uint8, generator=g))


def route(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token, uniformly among E; softmax-like positive weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    return ids, w / w.sum(dim=1, keepdim=True)


def run(args: argparse.Namespace) -> int:
    from dist_glm5.kernels import mxfp4_moe as K

    if not K.available():
        print("the MXFP4 MoE kernel is not available (see the warning above)")
        return 1
    isa = K.set_isa(args.isa)
    threads_before = torch.get_num_threads()
    results: dict = {"isa": isa, "bandwidth_gb_s": {}, "decode": [], "prefill": [], "sweep": []}
    for nt in args.threads:
        results["bandwidth_gb_s"][nt] = read_bandwidth(nt) / 1e9
    print(f"kernel path: {isa}; read bandwidth (torch sum, 1 GiB fp32): "
          + ", ".join(f"{nt} thread(s) {bw:.1f} GB/s" for nt, bw in results["bandwidth_gb_s"].items()))

    for name in args.models:
        H, I, E, k = MODELS[name]
        w = make_experts(E, H, I)
        per_expert = sum(t[0].numel() for t in w)
        print(f"\n{name}: H={H} I={I}, {E} experts allocated ({per_expert / 1e6:.1f} MB packed "
              f"each), top-{k}")
        print(f"{'thr':>3} {'tokens':>6} {'experts':>7} {'kernel ms':>10} {'GB/s':>6} "
              f"{'of bw':>6} {'dequant ms':>11} {'speed-up':>8}")
        for nt in args.threads:
            torch.set_num_threads(nt)
            for T in args.batches:
                ids, tw = route(T, E, k, seed=T)
                touched = int(ids.unique().numel())
                x = torch.randn(T, H)
                t_k = best_time(lambda: K.moe_mxfp4(x, ids, tw, *w, 0, E - 1), args.budget)
                t_d = best_time(lambda: K.moe_mxfp4_reference(x, ids, tw, *w, 0, E - 1), args.budget)
                gbs = touched * per_expert / t_k / 1e9
                row = {"model": name, "threads": nt, "tokens": T, "experts": touched,
                       "kernel_ms": 1e3 * t_k, "gb_s": gbs,
                       "of_bandwidth": gbs / results["bandwidth_gb_s"][nt],
                       "dequant_ms": 1e3 * t_d, "speedup": t_d / t_k}
                results["decode"].append(row)
                print(f"{nt:>3} {T:>6} {touched:>7} {row['kernel_ms']:>10.2f} {gbs:>6.2f} "
                      f"{row['of_bandwidth']:>6.0%} {row['dequant_ms']:>11.1f} {row['speedup']:>7.1f}x")

        if name in args.prefill_models and args.prefill:
            nt = max(args.threads)
            torch.set_num_threads(nt)
            print(f"prefill, {nt} thread(s): {'tokens':>6} {'auto ms':>9} {'fused ms':>9} "
                  f"{'dequant ms':>11}")
            for T in args.prefill:
                ids, tw = route(T, E, k, seed=T)
                x = torch.randn(T, H)
                t_a = best_time(lambda: K.moe_mxfp4(x, ids, tw, *w, 0, E - 1), args.budget)
                t_f = best_time(lambda: K.moe_mxfp4(x, ids, tw, *w, 0, E - 1,
                                                    gemm_min_routes=1 << 30), args.budget)
                t_d = best_time(lambda: K.moe_mxfp4_reference(x, ids, tw, *w, 0, E - 1), args.budget)
                results["prefill"].append({"model": name, "threads": nt, "tokens": T,
                                           "auto_ms": 1e3 * t_a, "fused_ms": 1e3 * t_f,
                                           "dequant_ms": 1e3 * t_d})
                print(f"{'':>21} {T:>6} {1e3 * t_a:>9.1f} {1e3 * t_f:>9.1f} {1e3 * t_d:>11.1f}")

        if args.sweep:
            nt = max(args.threads)
            torch.set_num_threads(nt)
            print(f"one expert, {nt} thread(s): {'routes':>6} {'fused ms':>9} {'gemm ms':>8}")
            one = tuple(t[:1] for t in w)
            for n in args.sweep:
                x, ids, tw = torch.randn(n, H), torch.zeros(n, 1, dtype=torch.int32), torch.ones(n, 1)
                t_f = best_time(lambda: K.moe_mxfp4(x, ids, tw, *one, 0, 0, gemm_min_routes=1 << 30),
                                args.budget / 2)
                t_g = best_time(lambda: K.moe_mxfp4(x, ids, tw, *one, 0, 0, gemm_min_routes=1),
                                args.budget / 2)
                results["sweep"].append({"model": name, "threads": nt, "routes": n,
                                         "fused_ms": 1e3 * t_f, "gemm_ms": 1e3 * t_g})
                print(f"{'':>24} {n:>6} {1e3 * t_f:>9.2f} {1e3 * t_g:>8.2f}")
        del w

    torch.set_num_threads(threads_before)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    register(parser)
    a = parser.parse_args()
    raise SystemExit(a.func(a))
