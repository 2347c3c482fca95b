"""The w4a8 MoE kernel (kernels/mxfp4_w4a8.py) against the exact one (kernels/mxfp4_moe.py),
measured side by side in one run: `python bench/w4a8.py`.

The small model's expert shapes (E=64, H=1024, I=512, top-8), seven layers' worth of distinct
random weights (about 370 MB: each call reads a layer the previous calls did not, so its experts
come from DRAM, not from the 32 MB L3), one thread. For T in (1, 8, 32) tokens: each kernel's
time, the ratio, and the GB/s of packed bytes read (w13, w2 and their scales, of the experts the
batch touches). Time is the calling thread's CPU time (time.thread_time; with one thread the
kernel runs in it), the best over all layers and repeats: on a shared, loaded machine wall time
counts other processes' turns.
"""

from __future__ import annotations

import time

import torch

from dist_glm5.kernels import mxfp4_moe, mxfp4_w4a8

E, H, I, K_TOP = 64, 1024, 512, 8
LAYERS = 7
BATCHES = (1, 8, 32)
REPEATS = 3  # passes over the layers per batch size


def make_layer(seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes; scale bytes 118..127 (weights of order 0.01-1, like real experts)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g),
        torch.randint(118, 128, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g),
        torch.randint(118, 128, (E, H, I // 32), dtype=torch.uint8, generator=g),
    )


def route(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token, uniformly among E; positive weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K_TOP, generator=g)
    return ids, w / w.sum(dim=1, keepdim=True)


def cpu_ms(fn) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1e3


def measure(layers: list[tuple[torch.Tensor, ...]], T: int) -> dict:
    """Best CPU ms of each kernel over LAYERS x REPEATS calls, alternating the kernels and
    moving to another layer before each call."""
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    ids, tw = route(T, seed=T)
    touched = len(torch.unique(ids))
    per_expert = sum(t[0].numel() for t in layers[0])
    kernels = {"exact": mxfp4_moe.moe_mxfp4, "w4a8": mxfp4_w4a8.moe_mxfp4_w4a8}
    best = {name: float("inf") for name in kernels}
    n = len(layers)
    for rep in range(REPEATS):
        for i in range(n):
            for j, (name, fn) in enumerate(kernels.items()):
                w = layers[(i + j * (n // 2) + rep) % n]  # the two kernels read different layers
                ms = cpu_ms(lambda fn=fn, w=w: fn(x, ids, tw, *w, 0, E - 1))
                best[name] = min(best[name], ms)
    gbytes = touched * per_expert / 1e9
    return {
        "T": T,
        "experts": touched,
        "exact_ms": best["exact"],
        "w4a8_ms": best["w4a8"],
        "ratio": best["exact"] / best["w4a8"],
        "exact_gbs": gbytes / best["exact"] * 1e3,
        "w4a8_gbs": gbytes / best["w4a8"] * 1e3,
    }


def main() -> list[dict]:
    torch.set_num_threads(1)
    assert mxfp4_moe.available() and mxfp4_w4a8.available(), "a kernel did not build"
    print(
        f"small model experts: E={E} H={H} I={I} k={K_TOP}, {LAYERS} layers, 1 thread, "
        f"exact path {mxfp4_moe.set_isa(None)}, w4a8 path {mxfp4_w4a8.set_isa(None)}"
    )
    layers = [make_layer(seed) for seed in range(LAYERS)]
    for w in layers[:2]:  # warm both kernels (build, tables, code) outside the timing
        ids, tw = route(2, seed=99)
        x = torch.randn(2, H)
        mxfp4_moe.moe_mxfp4(x, ids, tw, *w, 0, E - 1)
        mxfp4_w4a8.moe_mxfp4_w4a8(x, ids, tw, *w, 0, E - 1)
    print(
        f"{'T':>3} {'experts':>7} {'exact ms':>9} {'w4a8 ms':>8} {'ratio':>6} "
        f"{'exact GB/s':>10} {'w4a8 GB/s':>9}"
    )
    rows = []
    for T in BATCHES:
        r = measure(layers, T)
        rows.append(r)
        print(
            f"{T:>3} {r['experts']:>7} {r['exact_ms']:>9.3f} {r['w4a8_ms']:>8.3f} "
            f"{r['ratio']:>6.2f} {r['exact_gbs']:>10.2f} {r['w4a8_gbs']:>9.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
