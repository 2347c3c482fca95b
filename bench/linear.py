"""A decode step's few-row bf16 products, MEASURED side by side (`bench linear`): the C kernel
(kernels/bf16_gemv.c) against torch's bf16 F.linear and against the fp32 GEMM that first widens
the weight (ops/linear.linear_fp32_gemm), at 1..32 rows, with the weight's GB/s against the read
bandwidth measured in the same run.

Weights rotate through copies that total more than the last-level cache (this VM reports a
300 MB L3), so each call reads its weight from DRAM as a model's layers do. The rows where the
kernel stops beating the best torch path are where kernels/bf16_gemv.ROWS should sit."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dist_glm5.kernels import bf16_gemv
from dist_glm5.obs.bandwidth import read_bandwidth
from dist_glm5.ops.linear import linear_fp32_gemm

log = logging.getLogger(__name__)

SHAPES = {  # name: (out, in) of a dense weight a decode step reads
    "small.mlp": (2816, 1024),
    "small.lm_head": (8192, 1024),
    "glm5.q_a": (2048, 6144),
    "glm5.o_proj": (6144, 16384),
}
ROTATE_BYTES = 768 << 20


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=20, help="calls per point (best of them)")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=main)


def _best(fn, x: torch.Tensor, ws: list[torch.Tensor], repeats: int) -> float:
    fn(x, ws[0])  # warm: the interpreter and the code, as serving keeps them
    best = float("inf")
    for i in range(repeats):
        w = ws[(i + 1) % len(ws)]
        t0 = time.perf_counter()
        fn(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def _rows_cap(m: int):
    """The kernel measured past its routing cap too (where the crossover is looked for)."""
    old = bf16_gemv.ROWS
    bf16_gemv.ROWS = max(old, m)
    try:
        yield
    finally:
        bf16_gemv.ROWS = old


def main(args: argparse.Namespace) -> int:
    if not bf16_gemv.available():
        log.error("kernels/bf16_gemv.c did not build here: nothing to measure (see the warning)")
        return 1
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        bw = read_bandwidth(threads)
        print(f"\n{threads} thread(s), read bandwidth {bw / 1e9:.1f} GB/s (measured)")
        print(
            f"  {'weight':15s} {'rows':>4s} {'kernel us':>10s} {'GB/s':>6s} {'of bw':>6s}"
            f" {'torch bf16':>10s} {'fp32 GEMM':>10s} {'best torch / kernel':>20s}"
        )
        for name in args.shapes:
            N, K = SHAPES[name]
            nbytes = N * K * 2
            copies = max(2, -(-ROTATE_BYTES // nbytes))
            g = torch.Generator().manual_seed(0)
            ws = [torch.randn(N, K, generator=g).bfloat16() for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, K, generator=g).bfloat16()
                with _rows_cap(m):
                    kern = _best(bf16_gemv.linear, x, ws, args.repeats)
                tb = _best(F.linear, x, ws, args.repeats)
                tf = _best(linear_fp32_gemm, x, ws, args.repeats)
                ratio = min(tb, tf) / kern
                print(
                    f"  {name:15s} {m:4d} {kern * 1e6:10.0f} {nbytes / kern / 1e9:6.1f}"
                    f" {nbytes / kern / bw:6.0%} {tb * 1e6:10.0f} {tf * 1e6:10.0f}"
                    f" {ratio:19.2f}x"
                )
                results.append(
                    dict(
                        threads=threads,
                        weight=name,
                        rows=m,
                        kernel_s=kern,
                        torch_bf16_s=tb,
                        fp32_gemm_s=tf,
                        read_bw=bw,
                    )
                )
            del ws
    print(f"\nkernels/bf16_gemv.ROWS = {bf16_gemv.ROWS}: products of more rows take the torch path")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0
