"""Serving figures for the embedded model: time from `launch single-node` to the first served token,
then tokens/s and time to first token with 1 and 8 concurrent streaming clients (one run)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LAUNCH = [
    sys.executable,
    "-c",
    "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
]


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def one(client, model: str, max_tokens: int, i: int) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    ttft, n = None, 0
    for ch in client.completions.create(
        model=model,
        prompt=f"request {i}: tell me something",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if ch.choices and ch.choices[0].text:
            ttft = ttft or time.perf_counter() - t0
        n += 1
    return ttft or 0.0, max_tokens, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    import openai

    t0 = time.perf_counter()
    p = subprocess.Popen(
        [*LAUNCH, "single-node", "--ctx", "8k", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready = json.loads(p.stdout.readline())
        client = openai.OpenAI(base_url=ready["url"], api_key="none", max_retries=0)
        model = ready["model"]
        first = client.completions.create(model=model, prompt="hi", max_tokens=1)
        startup = time.perf_counter() - t0
        assert first.usage.completion_tokens == 1
        rows = []
        for n in args.clients:
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as ex:
                res = list(
                    ex.map(
                        lambda i: one(client, model, args.max_tokens, i),
                        range(n * args.requests_per_client),
                    )
                )
            wall = time.perf_counter() - t
            rows.append(
                {
                    "clients": n,
                    "tokens_per_s": sum(r[1] for r in res) / wall,
                    "ttft_median_ms": 1e3 * statistics.median(r[0] for r in res),
                    "ttft_max_ms": 1e3 * max(r[0] for r in res),
                }
            )
    finally:
        p.terminate()
        p.wait(timeout=30)
    print(
        f"launch single-node -> first served token: {startup:.2f} s (embedded model, model already "
        "cached)"
    )
    for r in rows:
        print(
            f"{r['clients']:>2} concurrent client(s): {r['tokens_per_s']:7.1f} tokens/s, time to "
            f"first token median {r['ttft_median_ms']:.0f} ms, max {r['ttft_max_ms']:.0f} ms"
        )
    if args.output:
        Path(args.output).write_text(json.dumps({"startup_s": startup, "rows": rows}, indent=1))
    return 0
