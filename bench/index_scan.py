"""The DSA indexer's decode selection over int8 keys, MEASURED side by side (`bench index-scan`):
kernels/dsa_select.c's three paths for int8 keys (AMX `tdpbssd`, AVX-512 VNNI `vpdpbusd`, the
portable fp32 tiles), each where this CPU has it, on the same keys and queries. One decode row of
each of 8 sequences over C keys (`select_many`: the scan of every key, then the exact top-k), at
the embedded model's indexer shape (16 heads x 32), the bench model's (8 x 64) and GLM-5's
(32 x 128, top-2048). Prints ms a call, ns per key and row, and each path's speed-up over VNNI."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from dist_glm5.bench.generate_vs_hf import best
from dist_glm5.kernels import dsa_select
from dist_glm5.model.kv_cache import KeySlots
from dist_glm5.ops.key_slots import RowsKeys
from dist_glm5.quant import index_q8

SHAPES = {  # name: (indexer heads, head dim, top-k)
    "embedded": (16, 32, 64),
    "small": (8, 64, 256),
    "glm5": (32, 128, 2048),
}
SEQS, BLOCK = 8, 64


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=20, help="calls per point (best of them)")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=main)


def case(H: int, D: int, L: int, seed: int = 0):
    """8 sequences' keys (each in its own blocks of the store) and one query row each."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-L // BLOCK)
    store = index_q8.pack(torch.randn(SEQS * nb * BLOCK, D, generator=g))
    keys = [KeySlots(torch.arange(s * nb, (s + 1) * nb), BLOCK, L) for s in range(SEQS)]
    rows = RowsKeys.of(
        torch.zeros(SEQS, dtype=torch.int64), torch.full((SEQS,), L - 1), [1] * SEQS, keys
    )
    return torch.randn(SEQS, H, D, generator=g), torch.randn(SEQS, H, generator=g), store, rows


def paths(D: int, H: int) -> list[str]:
    """The int8 paths this CPU runs for this shape (portable always)."""
    out = ["amx"] if dsa_select.uses_amx(D, H) else []
    return out + (["vnni"] if dsa_select.uses_vnni(D) else []) + ["portable"]


def timed(path: str, fn, repeats: int) -> tuple[float, torch.Tensor]:
    with dsa_select.int8_path(path):
        slots = fn()[0]  # warm, and what this path selects
        return best(fn, repeats), slots


def main(args: argparse.Namespace) -> int:
    if not dsa_select.available():
        raise SystemExit("the dsa_select kernel did not build (gcc and -fopenmp are needed)")
    before, res = torch.get_num_threads(), []
    print(f"int8 index keys, {SEQS} sequences x 1 decode row, select_many (scan + top-k)")
    try:
        for name in args.shapes:
            H, D, k = SHAPES[name]
            for L in args.contexts:
                q, w, store, rows = case(H, D, L)
                fn = functools.partial(dsa_select.select_many, q, w, store, rows, k, D)
                for nt in args.threads:
                    torch.set_num_threads(nt)
                    got = {}
                    for path in paths(D, H):
                        got[path] = timed(path, fn, args.repeats)
                    vnni = got.get("vnni", got["portable"])[0]
                    same = all(torch.equal(s, got["portable"][1]) for _, s in got.values())
                    for path, (t, _) in got.items():
                        res.append(
                            {"shape": name, "context": L, "threads": nt, "path": path, "s": t}
                        )
                        print(
                            f"  {name:8} ({H:2} x {D:3}) at {L:>6}, {nt} thread(s), {path:8}: "
                            f"{t * 1e3:7.3f} ms, {t * 1e9 / (SEQS * L):5.2f} ns a key-row, "
                            f"{vnni / t:5.2f}x of VNNI"
                        )
                    print(f"    the paths select the same keys: {same}")
    finally:
        torch.set_num_threads(before)
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))
    return 0
