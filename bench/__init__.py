"""`dist-glm5 bench` (installed as dist_glm5.bench): benchmarks that print ratios measured side by
side."""

from __future__ import annotations

import argparse


def register(p: argparse.ArgumentParser) -> None:
    from . import all as all_
    from . import (
        decode,
        encoder,
        engine_host,
        generate_vs_hf,
        index_scan,
        kernels,
        linear,
        link_faults,
        long_job,
        longctx,
        mla_decode,
        model_gates,
        netns,
        peers,
        pipeline,
        probe_server,
        quality,
        roofline,
        serve,
        structured,
        train_default,
    )

    sub = p.add_subparsers(dest="bench_command", required=True)
    all_.register(
        sub.add_parser(
            "all", help="every benchmark in one run: all.json and a markdown table of ratios"
        )
    )
    decode.register(
        sub.add_parser(
            "decode", help="small model decode/prefill: MXFP4 vs BF16 vs transformers vs roofline"
        )
    )
    peers.register(
        sub.add_parser(
            "peers", help="ours vs llama.cpp (built here) on the small model: tok/s and ratio"
        )
    )
    encoder.register(
        sub.add_parser(
            "encoder", help="MXFP4 encoder throughput and peak RSS vs amd-quark and torchao"
        )
    )
    kernels.register(
        sub.add_parser("kernels", help="MXFP4 MoE kernel vs dequant+GEMM and read bandwidth")
    )
    linear.register(
        sub.add_parser("linear", help="few-row bf16 products: C kernel vs torch bf16 vs fp32 GEMM")
    )
    mla_decode.register(
        sub.add_parser("mla-decode", help="a layer's sparse MLA decode: C kernel vs its torch form")
    )
    index_scan.register(
        sub.add_parser(
            "index-scan", help="the indexer's int8 selection: AMX vs VNNI vs portable, side by side"
        )
    )
    longctx.register(
        sub.add_parser(
            "longctx", help="decode ms/token vs context, prefill vs context, bisection vs topk"
        )
    )
    long_job.register(
        sub.add_parser(
            "long-job",
            help="one long prompt through launch batch: TTFT vs compute bound, RSS vs plan, "
            "pipeline vs one process",
        )
    )
    roofline.register(
        sub.add_parser(
            "roofline", help="bytes per decode step per card and the bound they set (computed)"
        )
    )
    serve.register(
        sub.add_parser(
            "serve",
            help="1/8/32/64 streaming clients: TTFT, ITL, tokens/s, failures; server CPU/token",
        )
    )
    engine_host.register(
        sub.add_parser(
            "engine-host", help="host time of one decode step (plan + metadata) vs context"
        )
    )
    structured.register(
        sub.add_parser(
            "structured",
            help="grammar mask ms per decode step (large JSON schema, byte and GLM-5-sized "
            "vocabularies) and structured vs free tok/s at batch 1 and 16",
        )
    )
    pipeline.register(
        sub.add_parser(
            "pipeline", help="per-stage utilisation, 2 vs 1 stages, MTP tokens/step, transfer cost"
        )
    )
    train_default.register(
        sub.add_parser(
            "train-default", help="train the shipped default model (resumable; ~2 h, 1 thread)"
        )
    )
    model_gates.register(
        sub.add_parser(
            "model-gates",
            help="the default model as a newcomer sees it: code, tool calls, JSON, needles, MTP",
        )
    )
    quality.register(
        sub.add_parser(
            "quality",
            help="trained model: bits/byte, MTP acceptance, needles, MXFP4 KL, repeated word",
        )
    )
    generate_vs_hf.register(
        sub.add_parser("generate", help="generate() against transformers, prefill and decode tok/s")
    )
    netns.register(
        sub.add_parser(
            "netns",
            help="two Ray nodes on one machine: network namespaces + veth (up, down, status, exec)",
        )
    )
    link_faults.register(
        sub.add_parser(
            "link-faults",
            help="two-node serving under tc netem delay, loss and a cut link: exact or failed, "
            "never hung",
        )
    )
    probe_server.register(
        sub.add_parser(
            "probe-server",
            help="a live server under poison requests and an idle/slowloris socket flood: "
            "status, /health latency, an innocent stream's gaps and exactness",
        )
    )
