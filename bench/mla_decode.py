"""A layer's sparse MLA decode, MEASURED side by side (`bench mla-decode`): the C kernel
(kernels/mla_decode.c) against its torch form (ops/attention.absorbed_gathered with the fp32
GEMM einsum, what the CPU backend falls back to), at 1..32 decode rows and 1-2 threads, with the
arithmetic rate each reaches. The selected keys point anywhere in a cache of 64K rows, as a long
context's do (21 MB for the small shape, 75 MB for GLM-5's: beyond this VM's 32 MB L3)."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from dist_glm5.bench.generate_vs_hf import best
from dist_glm5.kernels import mla_decode
from dist_glm5.ops.attention import absorbed_gathered
from dist_glm5.ops.linear import einsum_fp32_gemm

# name: (heads, nope, v, kv_lora c, rope r, index_topk k) of one layer (one rank's heads)
SHAPES = {
    "small": (8, 64, 64, 128, 32, 256),  # bench decode's model
    "glm5.tp8": (8, 192, 256, 512, 64, 2048),  # GLM-5's 64 heads over 8 ranks
}
CACHE_ROWS = 1 << 16


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=10, help="calls per point (best of them)")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=main)


def case(shape: tuple[int, ...], n: int, seed: int = 0) -> tuple:
    h, nope, v, c, r, k = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, nope + r, generator=g).to(torch.bfloat16)
    w = (torch.randn(h * (nope + v), c, generator=g) * 0.05).to(torch.bfloat16)
    kv = torch.randn(CACHE_ROWS, c + r, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, CACHE_ROWS, (n, k), generator=g)
    valid = torch.ones(n, k, dtype=torch.bool)
    return q[..., :nope], q[..., nope:].contiguous(), w, kv, slots, valid, nope


def macs(shape: tuple[int, ...], n: int) -> int:
    """Multiply-adds of n rows: W_uk, scores, softmax . latents, W_uv (written out)."""
    h, nope, v, c, r, k = shape
    return n * h * (nope * c + k * (c + r) + k * c + c * v)


def _best(fn, repeats: int) -> float:
    fn()  # warm
    return best(fn, repeats)


def main(args: argparse.Namespace) -> int:
    if not mla_decode.available():
        raise SystemExit("bench mla-decode: the kernel did not build (see the warning above)")
    torch_form = functools.partial(absorbed_gathered, einsum=einsum_fp32_gemm)
    rows_out, old = [], torch.get_num_threads()
    print(f"{'shape':>9} {'thr':>3} {'rows':>4} {'kernel us':>10} {'torch us':>9} "
          f"{'torch/kernel':>12} {'kernel GMAC/s':>13}")  # fmt: skip
    try:
        for name in args.shapes:
            for t in args.threads:
                torch.set_num_threads(t)
                for n in args.rows:
                    a = case(SHAPES[name], n)
                    got = mla_decode.absorbed_gathered(*a, 0.1, 1 << 29)
                    want = torch_form(*a, 0.1, 1 << 29)
                    err = (got.float() - want.float()).abs().max().item()
                    k_s = _best(
                        lambda a=a: mla_decode.absorbed_gathered(*a, 0.1, 1 << 29), args.repeats
                    )
                    t_s = _best(lambda a=a: torch_form(*a, 0.1, 1 << 29), args.repeats)
                    r = {
                        "shape": name, "threads": t, "rows": n, "kernel_us": k_s * 1e6,
                        "torch_us": t_s * 1e6, "ratio": t_s / k_s,
                        "kernel_gmac_s": macs(SHAPES[name], n) / k_s / 1e9, "max_abs_diff": err,
                    }  # fmt: skip
                    rows_out.append(r)
                    print(f"{name:>9} {t:>3} {n:>4} {r['kernel_us']:>10.1f} {r['torch_us']:>9.1f} "
                          f"{r['ratio']:>11.2f}x {r['kernel_gmac_s']:>13.1f}")  # fmt: skip
    finally:
        torch.set_num_threads(old)
    if args.output:
        Path(args.output).write_text(json.dumps(rows_out, indent=2) + "\n")
    return 0
