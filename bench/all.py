"""`dist-glm5 bench all`: every benchmark the issues asked for, in one run, into one JSON and a
markdown table of the ratios each measured side by side (generate vs transformers, encoder vs
amd-quark and torchao, decode time against context, pipeline utilisation, MTP tokens per step,
serving, roofline)."""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output", default="bench-results", help="directory for all.json and summary.md"
    )
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="benchmarks to leave out (generate kernels decode encoder longctx pipeline serve "
        "engine-host structured)",
    )
    p.set_defaults(func=run)


def _run(mod, argv: list[str]) -> dict | list:
    p = argparse.ArgumentParser()
    mod.register(p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        args = p.parse_args([*argv, "--output", str(out)])
        args.func(args)
        return json.loads(out.read_text())


def run(args: argparse.Namespace) -> int:
    from . import (
        decode,
        encoder,
        engine_host,
        generate_vs_hf,
        kernels,
        longctx,
        pipeline,
        roofline,
        serve,
        structured,
    )

    plan = [
        ("generate", generate_vs_hf, []),
        ("kernels", kernels, []),
        ("decode", decode, []),
        ("encoder", encoder, []),
        ("longctx", longctx, []),
        ("pipeline", pipeline, []),
        ("serve", serve, []),
        ("engine-host", engine_host, []),
        ("structured", structured, []),
        ("roofline", roofline, []),
    ]
    res = {}
    for name, mod, argv in plan:
        if name in args.skip:
            continue
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        res[name] = _run(mod, argv)
        res[name + "_seconds"] = time.perf_counter() - t
    md = ["| benchmark | measurement | value |", "|---|---|---|"]
    for name, _, _ in plan:  # the table's rows in the plan's order
        if name in res:
            md += _ROWS[name](res[name])
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "all.json").write_text(json.dumps(res, indent=1))
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


# ---- summary.md: one function per benchmark, from its JSON to its table rows ----------------
def _generate_rows(g: list) -> list[str]:
    return [
        f"| generate vs transformers | batch {r['batch']}: prefill / decode tok/s ratio | "
        f"{r['prefill_ratio']:.2f} / {r['decode_ratio']:.2f} |"
        for r in g
    ]


def _kernels_rows(k: dict) -> list[str]:
    return [
        f"| MXFP4 MoE kernel | {r['model']}, {r['threads']} thread(s), batch 1: of read "
        f"bandwidth; x dequantise-then-GEMM | {r['of_bandwidth']:.0%}; "
        f"{r['speedup']:.1f}x |"
        for r in (k or {}).get("decode", [])
        if r["tokens"] == 1
    ]


def _decode_rows(d: list) -> list[str]:
    md = []
    for r in d:
        mx, bf = r["mxfp4"], r["bf16"]
        hf = f"; {mx['decode_tok_s'] / r['hf_bf16']['decode_tok_s']:.2f}x" if "hf_bf16" in r else ""
        md.append(
            f"| small model decode | {r['threads']} thread(s): MXFP4 / BF16; MXFP4 / "
            f"transformers BF16; step x roofline (MXFP4, BF16) | "
            f"{mx['decode_tok_s'] / bf['decode_tok_s']:.2f}x{hf}; {mx['of_bound']:.1f}x, "
            f"{bf['of_bound']:.1f}x |"
        )
    return md


def _encoder_rows(e: dict) -> list[str]:
    md = []
    thr = [r for r in (e or {}).get("throughput", [])]
    for th in sorted({r["threads"] for r in thr}):
        rows = {r["encoder"]: r for r in thr if r["threads"] == th}
        if "amd-quark" in rows:
            best = max(v["gb_s"] for k, v in rows.items() if k.startswith("ours-quark"))
            md.append(
                f"| MXFP4 encoder | {th} thread(s): ours (quark rule) / amd-quark | "
                f"{best / rows['amd-quark']['gb_s']:.1f}x |"
            )
    for r in (e or {}).get("convert_rss", []):
        md.append(
            f"| convert glm53 | peak RSS at {r['input_gb']:.1f} GB input | {r['peak_rss_mb']:.0f} "
            "MB |"
        )
    return md


def _longctx_rows(lc: dict) -> list[str]:
    lc = lc or {}
    md = [
        f"| long context TTFT | {r['context']} tokens, {r['stages']} stage(s): s; x "
        f"compute bound | {r['ttft_s']:.1f}; {r['ttft_s'] / r['bound_s']:.1f}x |"
        for r in lc.get("ttft", [])
        if "ttft_s" in r
    ]
    for r in lc.get("decode", []):
        first = next(x for x in lc["decode"] if x["batch"] == r["batch"])
        if "ms_per_step" in r and "ms_per_step" in first:
            md.append(
                f"| long context decode | batch {r['batch']} at {r['context']}: ms/step (x of "
                f"{first['context']}) | {r['ms_per_step']:.2f} "
                f"({r['ms_per_step'] / first['ms_per_step']:.2f}x) |"
            )
    return md


def _pipeline_rows(p: list) -> list[str]:
    md = []
    for r in p:
        util = ", ".join(f"{k} {v:.0%}" for k, v in r["utilisation"].items())
        md.append(
            f"| pipeline | {r['stages']} stage(s), {r['microbatches']} "
            f"micro-batch(es){', MTP' if r['mtp'] else ''} | {r['tokens_per_s']:.0f} tok/s; "
            f"{util}; {r['decode_tokens_per_step']:.2f} tok/step |"
        )
    return md


def _serve_rows(s: dict) -> list[str]:
    md = [f"| serve | launch -> first token | {s['startup_s']:.2f} s |"]
    for r in s.get("rows", []):
        md.append(
            f"| serve | {r['clients']} streaming client(s): output tok/s; TTFT p50/p99; ITL "
            f"p50/p99; failed | {r['tokens_per_s']:.0f}; {r.get('ttft_median_ms', 0):.0f}/"
            f"{r.get('ttft_p99_ms', 0):.0f} ms; {r.get('itl_median_ms', 0):.0f}/"
            f"{r.get('itl_p99_ms', 0):.0f} ms; {r['failed']} |"
        )
    if "cpu_per_token" in s:
        c = s["cpu_per_token"]
        md.append(
            f"| serve | server CPU per streamed token, first / last {c['window']} of "
            f"{c['tokens']} | {c['first_us']:.0f} / {c['last_us']:.0f} us ({c['ratio']:.2f}x) |"
        )
    return md


def _engine_host_rows(e: dict) -> list[str]:
    return [
        f"| engine host | one decode step, {r['sequences']} sequences at {r['context']} "
        f"tokens (x of {e['rows'][0]['context']}) | {r['step_ms']:.3f} ms "
        f"({r['step_ms'] / e['rows'][0]['step_ms']:.2f}x) |"
        for r in e["rows"]
    ]


def _structured_rows(s: dict) -> list[str]:
    md = [
        f"| structured output | grammar mask per decode step, large JSON schema, "
        f"{s[k]['vocab']}-token vocabulary | {s[k]['step_ms']['mean']:.3f} ms |"
        for k in ("mask_model_vocab", "mask_glm5_vocab")
    ]
    for r in s["engine"]:
        md.append(
            f"| structured output | batch {r['batch']}: structured / free tok/s (step ms) | "
            f"{r['ratio']:.2f}x ({r['structured_step_ms']:.1f} / {r['free_step_ms']:.1f}) |"
        )
    return md


def _roofline_rows(rf: list) -> list[str]:
    return [
        f"| roofline (computed, Gaudi 2) | stage {r['stage']} bytes per decode step | "
        f"{r['total'] / 1e9:.2f} GB |"
        for r in rf
    ]


_ROWS = {
    "generate": _generate_rows,
    "kernels": _kernels_rows,
    "decode": _decode_rows,
    "encoder": _encoder_rows,
    "longctx": _longctx_rows,
    "pipeline": _pipeline_rows,
    "serve": _serve_rows,
    "engine-host": _engine_host_rows,
    "structured": _structured_rows,
    "roofline": _roofline_rows,
}
