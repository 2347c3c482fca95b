"""Long-context benchmarks on the embedded model, one process per measurement (clean peak RSS):

- decode time per token at 4K, 16K, 64K context, sparse DSA path (the cache is filled with
  synthetic rows: decode work does not depend on the values), beside transformers where it reaches;
- prefill time against context, sparse path against the dense reference;
- the bisection k-th score against torch.topk on the same rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

_DECODE = r"""
import json, sys, time, torch
from dist_glm5.obs.peak_rss import peak_rss_mb
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.checkpoint.loader import load_model
torch.set_num_threads(1)
ctx, steps = int(sys.argv[1]), int(sys.argv[2])
m = load_model(ensure_default_model(), mtp=False).set_dsa(DSAConfig(mode="sparse"))
cache = m.new_cache(ctx // 64 + 2, 64)
g = torch.Generator().manual_seed(0)
cache.prepare([Chunk(0, 0, ctx)])
for store in [*cache.kv.values(), *cache.index_k.values()]:
    store.normal_(generator=g)
times = []
with torch.no_grad():
    for i in range(steps):
        t = time.perf_counter()
        b = cache.prepare([Chunk(0, ctx + i, 1)])
        h, _ = m(torch.tensor([i % 256]), b, cache)
        m.logits(m.final_norm(h))
        times.append(time.perf_counter() - t)
print(json.dumps({"ms_per_token": 1e3 * sorted(times)[len(times) // 2],
                  "peak_rss_mb": peak_rss_mb()}))
"""

_HF_DECODE = r"""
import json, sys, tempfile, time, torch
from dist_glm5.obs.peak_rss import peak_rss_mb
from pathlib import Path
from transformers import GlmMoeDsaForCausalLM
from dist_glm5.bench.generate_vs_hf import hf_copy
from dist_glm5.checkpoint.default_model import ensure_default_model
torch.set_num_threads(1)
ctx, steps = int(sys.argv[1]), int(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    m = GlmMoeDsaForCausalLM.from_pretrained(hf_copy(ensure_default_model(), Path(tmp))).eval()
ids = torch.randint(0, 256, (1, ctx))
with torch.no_grad():
    out = m(ids, use_cache=True)
    cache, tok, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for i in range(steps):
        t = time.perf_counter()
        out = m(tok, past_key_values=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t)
print(json.dumps({"ms_per_token": 1e3 * sorted(times)[len(times) // 2],
                  "peak_rss_mb": peak_rss_mb()}))
"""

_PREFILL = r"""
import json, sys, time, torch
from dist_glm5.obs.peak_rss import peak_rss_mb
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.checkpoint.loader import load_model
torch.set_num_threads(1)
ctx, mode, thr = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
m = load_model(ensure_default_model(), mtp=False).set_dsa(DSAConfig(mode=mode, dense_threshold=thr))
cache = m.new_cache(ctx // 64 + 2, 64)
ids = torch.randint(0, 256, (ctx,))
t = time.perf_counter()
with torch.no_grad():
    for a in range(0, ctx, 1024):
        b = cache.prepare([Chunk(0, a, min(1024, ctx - a))])
        m(ids[a:a + 1024], b, cache)
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_rss_mb": peak_rss_mb()}))
"""


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument(
        "--hf-max-context", type=int, default=8192, help="transformers is measured up to here"
    )
    p.add_argument("--prefill-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def sub(code: str, *args) -> dict | None:
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True
    )
    if r.returncode:
        log.warning(
            "measurement %s failed: %s",
            args,
            r.stderr.strip().splitlines()[-1:] if r.stderr else r.returncode,
        )
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.ops.topk import kth_largest_bisect

    ensure_default_model()
    res: dict = {"decode": [], "prefill": [], "topk": []}
    print("decode, one sequence, 1 thread: ms per token (median), peak RSS")
    base = None
    for ctx in args.decode_contexts:
        ours = sub(_DECODE, ctx, args.steps)
        hf = sub(_HF_DECODE, ctx, args.steps) if ctx <= args.hf_max_context else None
        base = base or (ours and ours["ms_per_token"])
        res["decode"].append({"context": ctx, "ours": ours, "transformers": hf})
        line = (
            f"  {ctx:>7}: ours {ours['ms_per_token']:7.2f} ms ({ours['ms_per_token'] / base:.2f}x "
            f"of the first), RSS {ours['peak_rss_mb']:.0f} MB"
            if ours
            else f"  {ctx:>7}: ours failed"
        )
        if hf:
            line += f"; transformers {hf['ms_per_token']:7.2f} ms, RSS {hf['peak_rss_mb']:.0f} MB"
        print(line)
    print("prefill (chunks of 1024), 1 thread: seconds, peak RSS")
    for ctx in args.prefill_contexts:
        sp = sub(_PREFILL, ctx, "sparse", 0)
        ref = sub(_PREFILL, ctx, "reference", 0)
        res["prefill"].append({"context": ctx, "sparse": sp, "reference": ref})
        print(
            f"  {ctx:>7}: sparse {sp['seconds']:6.2f} s ({sp['peak_rss_mb']:.0f} MB), reference "
            + (f"{ref['seconds']:6.2f} s ({ref['peak_rss_mb']:.0f} MB)" if ref else "failed")
        )
    print("k-th largest score per row: bisection vs torch.topk (same rows, 1 thread)")
    torch.set_num_threads(1)
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
