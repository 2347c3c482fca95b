"""`bench serve`: serving figures against a real `launch single-node` on the embedded model (CPU),
in the conventions of vLLM's serving benchmark (vllm/benchmarks/serve.py).

1. Launch -> first served token (model already cached).

2. Concurrent streaming clients (default 1, 8, 32, 64; vLLM's `--max-concurrency` with an infinite
   request rate): each level sends `max(clients x --prompts-per-client, --min-prompts)` requests
   to /v1/completions, at most `clients` in flight. Prompt and output lengths are mixed as vLLM's
   random dataset mixes them: uniform integers in [len x (1 - r), len x (1 + r)] (`--input-len`,
   `--output-len`, `--range-ratio`); prompts are token ids (printable bytes), `ignore_eos` makes
   each request produce exactly its output length. Per request, as vLLM: TTFT = send -> first
   streamed token; ITL = the gaps between successive streamed tokens (chunks that carry text: our
   closing chunk carries only the finish reason and is not a token); TPOT = (latency - TTFT) /
   (output tokens - 1), output tokens from the usage chunk. Aggregated as vLLM: TTFT and TPOT
   over requests, ITL over every gap of every request, percentiles by np.percentile; output
   tokens/s = output tokens of the successful requests / the level's wall time. A request fails
   on an HTTP error, an error event, a broken stream, no finish reason, or fewer tokens than asked
   (goal: 0 failures). Preemptions and pipeline restarts during the level come from /metrics.
   The client runs in this process with httpx's async client and parses SSE itself (as vLLM's
   client does with aiohttp): the 2 cores are shared with the server, so the client is kept light.

3. Server CPU per streamed token, the first 100 against the last 100 tokens of a 4,096-token
   output (goal within 1.2x). What counts as the server is everything the serving process does
   per token besides the model: uvicorn and h11, FastAPI's streaming response, the pydantic chunk
   and its SSE line, the EngineClient's hop from the engine thread to the event loop, the engine
   loop's publish, the coordinator's incremental detokenizer and stop checks, the scheduler and
   block ledger, the worker's block tables and `prepare`. The model forward would dominate the
   process's CPU and its attention grows with the context, hiding any of that; so the server is
   built as `launch single-node` builds it (build_app, EngineClient, EngineLoop, Coordinator,
   InProcessPipeline, HttpServer) in a process of its own whose stage worker is
   `HostOnlyWorker` (bench/engine_host.py): the worker's host work, then a sleep of
   `--cpu-delay-ms` instead of the forward. Sleeping costs no CPU and paces the stream as a model
   would, so the server is never ahead of the client. The client reads the server process's CPU
   clock (clock_getcpuclockid: every thread, nanoseconds) when the chunk completing token k
   arrives (k from `continuous_usage_stats`): first = CPU(101) - CPU(1), last = CPU(4096) -
   CPU(3996), each over 100 tokens; medians of `--cpu-repeats` streams.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAUNCH = [
    sys.executable,
    "-c",
    "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
]
HOST_ONLY = [
    sys.executable,
    "-c",
    "from dist_glm5.bench.serve import host_only_server; host_only_server()",
]


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clients", type=int, nargs="*", default=[1, 8, 32, 64], help="concurrency levels"
    )
    p.add_argument("--prompts-per-client", type=int, default=2, help="requests per level / level")
    p.add_argument("--min-prompts", type=int, default=8, help="at least this many per level")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    p.add_argument(
        "--range-ratio", type=float, default=0.75, help="lengths uniform in len x [1 - r, 1 + r]"
    )
    p.add_argument("--ctx", default="32k", help="the server's --ctx (its cache holds one such)")
    p.add_argument("--model", help="checkpoint (default: the embedded model)")
    p.add_argument(
        "--server-args", default="", help="more `launch single-node` flags, e.g. '--microbatches 1'"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-tokens", type=int, default=4096, help="output length of the CPU run")
    p.add_argument("--cpu-window", type=int, default=100, help="tokens per CPU window")
    p.add_argument("--cpu-repeats", type=int, default=3, help="CPU streams (0: skip)")
    p.add_argument("--cpu-delay-ms", type=float, default=1.0, help="host-only step's stand-in")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


# ---- the server ---------------------------------------------------------------------------------


class Server:
    """A server process that prints its ready line ({"url", "model", ...}) on stdout."""

    def __init__(self, cmd: list[str]):
        env = {k: v for k, v in os.environ.items() if k != "DIST_GLM5_API_KEY"}
        self.p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        line = self.p.stdout.readline()
        if not line:
            self.p.wait(timeout=30)
            raise RuntimeError(f"{' '.join(cmd[3:])}: the server exited ({self.p.returncode})")
        ready = json.loads(line)
        self.url, self.model, self.pid = ready["url"], ready["model"], self.p.pid

    def close(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def host_only_server(argv: list[str] | None = None) -> None:
    """The server as `launch single-node` builds it, its stage worker a HostOnlyWorker (no model:
    a sleep of --delay-ms per step). Prints the ready line, serves until terminated."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--delay-ms", type=float, default=1.0)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)

    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.engine.config import CacheConfig, EngineConfig, StageSpec
    from dist_glm5.engine.coordinator import Coordinator
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.engine.scheduler import SchedulerConfig
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.launch.api.server import HttpServer, ServerSettings
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.stages.inprocess_pipeline import InProcessPipeline

    from .engine_host import HostOnlyWorker

    cfg, tok = ModelConfig.from_hf(a.model), load_tokenizer(a.model)
    sched = SchedulerConfig(max_model_len=a.ctx)  # launch's defaults: chunks 256, 2 micro-batches
    blocks = -(-(a.ctx + sched.chunk_tokens) // 64)  # one sequence of --ctx, as launch sizes it
    engine = EngineConfig(a.model, cache=CacheConfig(blocks, 64), scheduler=sched)
    HostOnlyWorker.delay_s = a.delay_ms / 1e3
    pipe = InProcessPipeline(StageSpec(engine), HostOnlyWorker)
    loop = EngineLoop(Coordinator(pipe, sched, cfg.eos_token_id, cfg.vocab_size, tok))
    settings = ServerSettings(port=0)
    client = EngineClient(loop)
    model = ModelInfo.from_model_dir(a.model, "host-only", loop.max_model_len, cfg.vocab_size, tok)
    server = HttpServer(build_app(client, model), settings)
    print(
        json.dumps({"event": "ready", "url": f"{server.url}/v1", "model": model.name}), flush=True
    )
    try:
        server.run()
    finally:
        client.close()
        loop.close()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# ---- 2: concurrent streaming clients ----------------------------------------------------------


def lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    """vLLM's random dataset: uniform integers in [mean x (1 - ratio), mean x (1 + ratio)]."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion, timed as vLLM times it (see the module docstring)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = {"prompt_len": len(prompt), "asked": max_tokens, "ttft": 0.0, "itl": [], "latency": 0.0}
    r.update(output_tokens=0, finish=None, error="")
    st = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/completions", json=body) as resp:
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r["error"] = f"error event: {chunk['error'].get('message', '')[:200]}"
                    break
                for c in chunk.get("choices") or ():
                    if c.get("text"):
                        now = time.perf_counter()
                        if r["ttft"] == 0.0:
                            r["ttft"] = now - st
                        else:
                            r["itl"].append(now - last)
                        last = now
                    r["finish"] = c.get("finish_reason") or r["finish"]
                if chunk.get("usage") and not chunk.get("choices"):
                    r["output_tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a broken stream, a reset connection: this request failed
        r["error"] = f"{type(e).__name__}: {e}"
    r["latency"] = last - st
    if not r["error"] and (r["finish"] is None or r["output_tokens"] != max_tokens):
        r["error"] = f"finish {r['finish']}, {r['output_tokens']} of {max_tokens} tokens"
    return r


async def level(url: str, model: str, clients: int, work: list[tuple[list[int], int]]) -> tuple:
    import httpx

    sem = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def gated(prompt, n):
            async with sem:
                return await one_request(client, url, model, prompt, n)

        t = time.perf_counter()
        res = await asyncio.gather(*(gated(p, n) for p, n in work))
        return res, time.perf_counter() - t


def aggregate(clients: int, res: list[dict], duration: float) -> dict:
    """vLLM's calculate_metrics over one level's requests (times in ms)."""
    import numpy as np

    ok = [r for r in res if not r["error"]]
    ttft = [1e3 * r["ttft"] for r in ok]
    itl = [1e3 * x for r in ok for x in r["itl"]]
    tpot = [
        1e3 * (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1)
        for r in ok
        if r["output_tokens"] > 1
    ]
    e2el = [1e3 * r["latency"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)

    def stats(name: str, xs: list[float]) -> dict:
        if not xs:
            return {}
        return {
            f"{name}_mean_ms": float(np.mean(xs)),
            f"{name}_median_ms": float(np.median(xs)),
            f"{name}_p99_ms": float(np.percentile(xs, 99)),
        }

    return {
        "clients": clients,
        "requests": len(res),
        "completed": len(ok),
        "failed": len(res) - len(ok),
        "errors": sorted({r["error"] for r in res if r["error"]})[:5],
        "duration_s": duration,
        "input_tokens": sum(r["prompt_len"] for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "tokens_per_s": out_tokens / duration,  # output tokens/s
        "total_tokens_per_s": (out_tokens + sum(r["prompt_len"] for r in ok)) / duration,
        **stats("ttft", ttft),
        **stats("tpot", tpot),
        **stats("itl", itl),
        **stats("e2el", e2el),
    }


def concurrency(args: argparse.Namespace, srv: Server) -> list[dict]:
    import httpx

    rows = []
    for clients in args.clients:
        rng = random.Random(args.seed * 1000 + clients)
        n = max(clients * args.prompts_per_client, args.min_prompts)
        ins = lengths(rng, args.input_len, args.range_ratio, n)
        outs = lengths(rng, args.output_len, args.range_ratio, n)
        work = [([rng.randint(32, 126) for _ in range(a)], b) for a, b in zip(ins, outs)]
        before = httpx.get(srv.url[: -len("/v1")] + "/metrics", timeout=30).text
        res, duration = asyncio.run(level(srv.url, srv.model, clients, work))
        after = httpx.get(srv.url[: -len("/v1")] + "/metrics", timeout=30).text
        r = aggregate(clients, res, duration)
        for key, name in (
            ("preemptions", "dist_glm5_num_preemptions_total"),
            ("pipeline_restarts", "dist_glm5_pipeline_restarts_total"),
        ):
            r[key] = int(_metric(after, name) - _metric(before, name))
        rows.append(r)
        print(
            f"{clients:>3} client(s), {r['requests']} requests ({min(ins)}-{max(ins)} prompt, "
            f"{min(outs)}-{max(outs)} output tokens) in {duration:.1f} s: "
            f"{r['tokens_per_s']:.1f} output tok/s; TTFT p50 {r.get('ttft_median_ms', 0):.0f} / "
            f"p99 {r.get('ttft_p99_ms', 0):.0f} ms; ITL p50 {r.get('itl_median_ms', 0):.1f} / "
            f"p99 {r.get('itl_p99_ms', 0):.1f} ms; TPOT p50 {r.get('tpot_median_ms', 0):.1f} ms; "
            f"failed {r['failed']}; preemptions {r['preemptions']}, restarts "
            f"{r['pipeline_restarts']}",
            flush=True,
        )
        for e in r["errors"]:
            print(f"      failure: {e}")
    return rows


# ---- 3: server CPU per streamed token -----------------------------------------------------------


def cpu_clock(pid: int):
    """A function returning process `pid`'s CPU time in seconds (all its threads, ns resolution)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    cid = ctypes.c_int()
    if libc.clock_getcpuclockid(pid, ctypes.byref(cid)):
        raise OSError(ctypes.get_errno(), f"clock_getcpuclockid({pid})")
    return lambda: time.clock_gettime(cid.value)


def cpu_stream(url: str, model: str, clock, tokens: int) -> list[tuple[int, float]]:
    """(tokens so far, server CPU seconds) at each streamed chunk of one `tokens`-token output."""
    import httpx

    body = {
        "model": model,
        "prompt": [ord(c) for c in "server CPU per token: "],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    samples = []
    with httpx.stream("POST", url + "/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    samples.append((chunk["usage"]["completion_tokens"], clock()))
    if not samples or samples[-1][0] != tokens:
        raise RuntimeError(f"the stream ended at {samples[-1][0] if samples else 0} tokens")
    return samples


def window(samples: list[tuple[int, float]], a: int, b: int) -> float:
    """Server CPU seconds per token between the chunks completing tokens a and b."""
    at = lambda k: next(s for s in samples if s[0] >= k)  # noqa: E731
    (na, ca), (nb, cb) = at(a), at(b)
    return (cb - ca) / (nb - na)


def server_cpu(args: argparse.Namespace, model_dir: Path) -> dict:
    n, w = args.cpu_tokens, args.cpu_window
    cmd = [*HOST_ONLY, "--model", str(model_dir), "--ctx", str(n + 1024)]
    srv = Server([*cmd, "--delay-ms", str(args.cpu_delay_ms)])
    try:
        clock = cpu_clock(srv.pid)
        cpu_stream(srv.url, srv.model, clock, 2 * w + 1)  # warm-up: imports, first-use paths
        runs = []
        for _ in range(args.cpu_repeats):
            s = cpu_stream(srv.url, srv.model, clock, n)
            runs.append(
                {
                    "first_us": 1e6 * window(s, 1, 1 + w),
                    "last_us": 1e6 * window(s, n - w, n),
                    "mean_us": 1e6 * window(s, 1, n),
                }
            )
    finally:
        srv.close()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"tokens": n, "window": w, "delay_ms": args.cpu_delay_ms, "runs": runs, **med}


# ---- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import httpx

    from dist_glm5.checkpoint.default_model import ensure_default_model

    d = Path(args.model) if args.model else ensure_default_model()
    res: dict = {"load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    if args.clients:
        t0 = time.perf_counter()
        cmd = [*LAUNCH, "single-node", "--model", str(d), "--ctx", args.ctx, "--port", "0"]
        srv = Server([*cmd, *shlex.split(args.server_args)])
        try:
            body = {"model": srv.model, "prompt": "hi", "max_tokens": 1}
            first = httpx.post(srv.url + "/completions", json=body, timeout=120).json()
            res["startup_s"] = time.perf_counter() - t0
            assert first["usage"]["completion_tokens"] == 1, first
            print(
                f"launch single-node -> first served token: {res['startup_s']:.2f} s ({d.name}, "
                f"--ctx {args.ctx}; load average {res['load_average']:.1f} on "
                f"{res['cpus']} CPUs)",
                flush=True,
            )
            res["rows"] = concurrency(args, srv)
        finally:
            srv.close()
    if args.cpu_repeats:
        c = res["cpu_per_token"] = server_cpu(args, d)
        c["ratio"] = c["last_us"] / c["first_us"]
        verdict = "within" if c["ratio"] <= 1.2 else "NOT within"
        print(
            f"server CPU per streamed token ({c['tokens']}-token output, host-only worker, "
            f"median of {args.cpu_repeats}): first {c['window']} {c['first_us']:.0f} us, last "
            f"{c['window']} {c['last_us']:.0f} us ({c['ratio']:.2f}x, goal {verdict} 1.2x); "
            f"whole stream {c['mean_us']:.0f} us"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))
    return 0
