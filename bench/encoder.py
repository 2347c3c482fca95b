"""MXFP4 encoder throughput and memory, side by side with amd-quark and torchao, in one run.

1. Throughput: GB of BF16 input per second encoding GLM-5 expert matrices (2048 x 6144), ours
   (both rules) against amd-quark (quark rule) and torchao FLOOR (ocp rule), at 1 and N threads.
   Each encoder runs in its own subprocess so its peak RSS is its own.
2. Flat memory: `convert glm53` on a synthetic 1 GB and a 4 GB BF16 checkpoint, peak RSS of each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_WORKER = r"""
import json, sys, time, torch
from dist_glm5.obs.peak_rss import peak_rss_mb
name, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
ws = [
    torch.randn(2048, 6144, generator=torch.Generator().manual_seed(i)).mul_(0.02)
    .to(torch.bfloat16)
    for i in range(n)
]
pool = None
if name.startswith("ours"):
    from dist_glm5.quant.mxfp4 import encode
    rule = name.split("-")[1]
    fn = lambda w: encode(w, rule)
    if name.endswith("-pool"):  # one matrix per thread, as `convert glm53 --workers N` runs them
        from concurrent.futures import ThreadPoolExecutor
        torch.set_num_threads(1)
        pool = ThreadPoolExecutor(threads)
elif name == "amd-quark":
    from dist_glm5.bench.oracles import quark_encoder
    fn = quark_encoder()
else:
    from dist_glm5.bench.oracles import torchao_encoder
    fn = torchao_encoder()
fn(ws[0])
t = time.perf_counter()
if pool:
    list(pool.map(fn, ws))
else:
    for w in ws:
        fn(w)
dt = time.perf_counter() - t
print(json.dumps({"gb_s": sum(w.numel() * 2 for w in ws) / dt / 1e9,
                  "peak_rss_mb": peak_rss_mb()}))
"""


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--matrices", type=int, default=8, help="2048x6144 bf16 matrices per timing")
    p.add_argument("--rss-sizes-gb", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def throughput(name: str, threads: int, n: int) -> dict | None:
    r = subprocess.run(
        [sys.executable, "-c", _WORKER, name, str(threads), str(n)], capture_output=True, text=True
    )
    if r.returncode:
        log.warning(
            "%s unavailable: %s",
            name,
            r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode,
        )
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def synthetic_bf16_checkpoint(dst: Path, gb: float) -> Path:
    """A GLM-5-architecture BF16 checkpoint whose routed experts total about `gb` GB, written
    streaming."""
    from dist_glm5.checkpoint.loader import hf_state_dict, meta_model
    from dist_glm5.checkpoint.safetensors_io import save_streaming
    from dist_glm5.model.config import ModelConfig

    H, I, E = 1024, 512, 64
    per_layer = E * 3 * H * I * 2
    layers = max(1, round(gb * 1e9 / per_layer))
    cfg = ModelConfig(
        vocab_size=1024,
        hidden_size=H,
        intermediate_size=2048,
        moe_intermediate_size=I,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=E,
        num_experts_per_tok=4,
        kv_lora_rank=64,
        q_lora_rank=128,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=64,
        index_head_dim=32,
        index_n_heads=4,
        first_k_dense_replace=0,
        torch_dtype="bfloat16",
    )
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg.to_hf()))
    plan = [
        (n, torch.float32 if "mlp.gate." in n else torch.bfloat16, tuple(t.shape))
        for n, t in sorted(hf_state_dict(meta_model(cfg)).items())
    ]

    def tensors():
        g = torch.Generator().manual_seed(0)
        for n, dt, shape in plan:
            yield n, (torch.randn(shape, generator=g) * 0.02).to(dt)

    save_streaming(dst / "model.safetensors", tensors(), plan=plan)
    return dst


def convert_rss(src: Path, dst: Path) -> tuple[float, float]:
    code = (
        "import sys, time; from dist_glm5.convert.glm53 import convert_glm53; from "
        "dist_glm5.obs.peak_rss import peak_rss_mb; t = time.perf_counter(); "
        "convert_glm53(sys.argv[1], sys.argv[2]); print(time.perf_counter() - t, peak_rss_mb())"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True, check=True
    )
    secs, rss = r.stdout.split()
    return float(secs), float(rss)


def run(args: argparse.Namespace) -> int:
    results: dict = {"throughput": [], "convert_rss": []}
    print(
        f"MXFP4 encode, 2048x6144 bf16 expert matrices x {args.matrices} (GB of bf16 input per "
        "second)"
    )
    print(f"{'threads':>7} {'encoder':>14} {'GB/s':>7} {'peak RSS MB':>12} {'vs amd-quark':>13}")
    for th in sorted(set(args.threads)):
        names = (
            ("ours-quark", "ours-ocp")
            + (("ours-quark-pool",) if th > 1 else ())
            + ("amd-quark", "torchao")
        )
        rows = {name: throughput(name, th, args.matrices) for name in names}
        ref = rows.get("amd-quark")
        for name, r in rows.items():
            if r is None:
                continue
            ratio = f"{r['gb_s'] / ref['gb_s']:.1f}x" if ref else "-"
            print(f"{th:>7} {name:>14} {r['gb_s']:>7.3f} {r['peak_rss_mb']:>12.0f} {ratio:>13}")
            results["throughput"].append({"threads": th, "encoder": name, **r})
    if not args.skip_rss:
        print("\nconvert glm53 peak RSS against checkpoint size (should be flat)")
        with tempfile.TemporaryDirectory() as tmp:
            for gb in args.rss_sizes_gb:
                src = synthetic_bf16_checkpoint(Path(tmp) / f"src{gb}", gb)
                size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
                secs, rss = convert_rss(src, Path(tmp) / f"dst{gb}")
                print(
                    f"  {size:5.2f} GB input: {secs:6.1f} s ({size / secs:.2f} GB/s end to end), "
                    f"peak RSS {rss:.0f} MB"
                )
                results["convert_rss"].append(
                    {"input_gb": size, "seconds": secs, "peak_rss_mb": rss}
                )
                for d in (src, Path(tmp) / f"dst{gb}"):
                    subprocess.run(["rm", "-rf", str(d)], check=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0
