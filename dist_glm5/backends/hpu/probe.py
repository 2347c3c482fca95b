"""First-run probes: one command per open item of shared/gaudi.md section 10, run on a Gaudi 2.

    python -m dist_glm5.backends.hpu.probe mxfp4      # item 1: native op in this mode, T = 1..16
    python -m dist_glm5.backends.hpu.probe sdpa       # item 2: FusedSDPA "None" vs "fp32"
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint NODE1:29500 \\
        -m dist_glm5.backends.hpu.probe hccl          # item 3: cross-node send/recv over HCCL
    python -m dist_glm5.backends.hpu.probe timer      # item 4: the driver's timeout_locked
    python -m dist_glm5.backends.hpu.probe topk       # item 5: torch.topk exact at k=2048, 637K?
    python -m dist_glm5.backends.hpu.probe rmsnorm    # item 6: FusedRMSNorm rounding
    python -m dist_glm5.backends.hpu.probe tpc        # item 7: the TPC op vs the codec, bit for bit

Each prints one JSON line (errors against the CPU reference, and seconds per call where timing
means something); nothing is asserted, the numbers go into the issue. `--device cpu` runs them on
the CPU (the tests do, with the fake stack) to keep the script itself honest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch

log = logging.getLogger(__name__)


def _timed(fn, device, reps=5):
    from . import _hf

    sync = _hf.hpu().synchronize if device != "cpu" else (lambda: None)
    out = fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return out, (time.perf_counter() - t0) / reps


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def mxfp4(device, H=6144, I=2048, E=32, k=8):
    from dist_glm5.ops.experts import experts_mxfp4_reference
    from dist_glm5.quant.mxfp4 import encode

    from . import moe

    g = torch.Generator().manual_seed(0)
    w13 = encode(torch.randn(E, 2 * I, H, generator=g) * 0.02)
    w2 = encode(torch.randn(E, H, I, generator=g) * 0.02)
    dev = [t.to(device) for t in (*w13, *w2)]
    rows = []
    for T in (1, 2, 4, 8, 16):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
        w = torch.rand(T, k, generator=g)
        want = experts_mxfp4_reference(x, ids, w, *w13, *w2, 0, E - 1)
        args = (x.to(device), ids.to(device), w.to(device), *dev, 0, E - 1)
        out, sec = _timed(lambda a=args: moe.experts_mxfp4(*a), device)
        rows.append({"T": T, "rel_err": _rel(out, want), "ms": 1e3 * sec})
    return {"lazy": os.environ.get("PT_HPU_LAZY_MODE"), "rows": rows}


def sdpa(device, n=512, L=8192, h=16):
    from dist_glm5.ops.attention import mla_expanded

    from . import attention

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    args = [
        torch.randn(*s, generator=g).to(bf)
        for s in ((1, n, h, 192), (1, n, h, 64), (1, L, 512), (1, L, 64), (h * 448, 512))
    ]
    keep = torch.ones(1, n, L, dtype=torch.bool).tril(L - n)
    want = mla_expanded(*[a.float() for a in args], keep, 256**-0.5, 192)
    dev = [a.to(device) for a in args] + [keep.to(device), 256**-0.5, 192]
    rows = {}
    for mode in ("None", "fp32"):
        out, sec = _timed(lambda m=mode: attention.mla_expanded(*dev, mode=m), device)
        o, w = out.float().cpu().flatten(2), want.flatten(2)
        cos = torch.nn.functional.cosine_similarity(o, w, dim=-1).min()
        rows[mode] = {"rel_err": _rel(out, want), "worst_row_cos": float(cos), "ms": 1e3 * sec}
    return rows


def hccl(device, steps=100, shape=(8192, 6144)):
    from .comm import HcclComm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    c = HcclComm(rank, 0, world, 1, "env://", device=device, timeout_s=300)
    t0, ok = time.perf_counter(), True
    for step in range(steps):
        if rank > 0:
            h = c.recv_hidden(shape, torch.bfloat16, step)
            ok &= bool((h[0, 0].float().cpu() == step % 256).all())
        if rank < world - 1:
            c.send_hidden(torch.full(shape, float(step % 256), dtype=torch.bfloat16), step)
    c.close()
    return {
        "rank": rank,
        "steps": steps,
        "ordered_and_intact": ok,
        "seconds": time.perf_counter() - t0,
    }


def timer(device):
    from .warmup import TIMEOUT_LOCKED, read_timeout_locked

    return {"path": str(TIMEOUT_LOCKED), "timeout_locked_s": read_timeout_locked()}


def topk(device, L=652_288, k=2048, rows=4):
    from dist_glm5.ops.indexer import select_topk_reference

    from . import indexer

    g = torch.Generator().manual_seed(0)
    s = torch.randint(-50, 50, (rows, L), generator=g).float() / 8  # many ties
    q_pos = torch.full((rows,), L - 1)
    want = select_topk_reference(s, q_pos, k)
    sd = s.to(device)
    t = torch.topk(sd, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, tie = sd > t, sd == t
    keep = above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    got, sec = _timed(lambda: indexer.select_topk(sd, q_pos.to(device), k), device)
    _, sec_topk = _timed(lambda: torch.topk(sd, k, dim=-1, sorted=False), device)
    return {
        "topk_exact": bool(torch.equal(keep.cpu(), want)),
        "bisection_exact": bool(torch.equal(got.cpu(), want)),
        "ms_bisection": 1e3 * sec,
        "ms_topk": 1e3 * sec_topk,
    }


def rmsnorm(device, D=6144, T=4096):
    from dist_glm5.ops.norm import rms_norm

    from . import _hf, norm_rope

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, D, generator=g) * 4).to(torch.bfloat16)
    w = torch.rand(D, generator=g).to(torch.bfloat16)
    want = rms_norm(x, w, 1e-6)
    xd, wd = x.to(device), w.to(device)
    ours = norm_rope.rms_norm(xd, wd, 1e-6).cpu()
    fused = _hf.fused_rms_norm().apply(xd, wd, 1e-6).cpu()  # weight multiplied inside

    def differ(a):
        return int((a.view(torch.int16) != want.view(torch.int16)).sum())

    return {
        "reference_order_bits_differ": differ(ours),
        "fused_weight_bits_differ": differ(fused),
        "elements": want.numel(),
    }


def tpc(device, R=64, K=6144):
    from dist_glm5.quant.mxfp4 import decode

    from . import custom_ops

    ops = custom_ops.load()
    if ops is None:
        return {"built": False}
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (R, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (R, K // 32), generator=g, dtype=torch.uint8)
    got = ops.dequant_perm(packed.to(device), scales.to(device)).cpu()
    want = decode(packed, scales, torch.bfloat16)[:, custom_ops.input_permutation(K)]
    return {
        "built": True,
        "bits_differ": int((got.view(torch.int16) != want.view(torch.int16)).sum()),
    }


PROBES = {f.__name__: f for f in (mxfp4, sdpa, hccl, timer, topk, rmsnorm, tpc)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("probe", choices=sorted(PROBES))
    p.add_argument("--device", default="hpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.device != "cpu":
        from dist_glm5.backends import get_backend

        get_backend("hpu")
    print(json.dumps({"probe": args.probe, **PROBES[args.probe](args.device)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
