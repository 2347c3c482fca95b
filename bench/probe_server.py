"""`dist-glm5 bench probe-server --url URL`: can one client or one request stall a live server?

Run it against a server of ours (`launch single-node ...`) on this machine; it sends traffic to
that URL only, bounded in count and time, and stops by itself. Two parts:

- poison: each poison request is sent while an innocent greedy stream runs and a poller asks
  /health every 10 ms. Per poison: its status (and the field its 400 names), the worst event-loop
  lag while it ran (the server's own `dist_glm5_event_loop_lag_seconds` histogram, scraped before
  and after: the bucket bound that holds every new observation), the worst /health latency (as a
  client sees it, this probe's own pauses included), the innocent stream's worst gap between
  chunks (it shares the engine's steps with the poison), and whether its text equals its solo
  run.
- flood: `--idle` sockets that never send a byte and `--slowloris` sockets that send a request
  head a byte at a time; meanwhile /health and short completions are timed (p50, p99, failures);
  then how long until the server has closed the idle and slow sockets.

Prints one table per part and, with --json, the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


@dataclass
class PoisonResult:
    name: str
    status: int
    param: str | None
    seconds: float  # the poison request's own latency
    loop_lag_ms: float  # the worst server loop lag while it ran (<= this bucket bound)
    health_p100_ms: float  # the worst /health latency while it ran
    stream_gap_ms: float  # the innocent stream's worst gap between chunks
    stream_exact: bool  # the innocent stream's text equals its solo run


@dataclass
class FloodResult:
    idle: int
    slowloris: int
    opened: int  # sockets the probe managed to open
    requests: int
    failed: int
    p50_ms: float
    p99_ms: float
    closed_by_server: int  # flood sockets the server closed before the probe gave up
    all_closed_s: float | None  # when the last of them was closed (None: some still open)
    statuses: dict[int, int] = field(default_factory=dict)


# ---- poison inputs --------------------------------------------------------------------------


def poison_cases(max_model_len: int) -> list[tuple[str, str, dict | bytes]]:
    """(name, path, body): each within or just past the server's default limits."""
    long_prompt = min(8192, max_model_len - 8)
    words = [f"w{i}x" for i in range(40_000)]
    stops = [f"{i:04d}" * 250 for i in range(64)]
    return [
        ("bad_words 40,000", "/v1/completions", {"prompt": "hi", "bad_words": words}),
        (
            "bad_words 1,024",
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 4, "bad_words": words[:1024]},
        ),
        ("stop 1,000,000", "/v1/completions", {"prompt": "hi", "stop": ["s"] * 1_000_000}),
        (
            "stop 64 x 1,000 chars",
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 8, "stop": stops},
        ),
        (
            "prompt_logprobs 20, long prompt",
            "/v1/completions",
            {"prompt": [65] * long_prompt, "max_tokens": 1, "prompt_logprobs": 20},
        ),
        (
            "echo + logprobs 20, long prompt",
            "/v1/completions",
            {
                "prompt": [66] * long_prompt,
                "max_tokens": 1,
                "echo": True,
                "logprobs": 20,
                "stream": True,
            },
        ),
        ("body 30 MB", "/v1/completions", b'{"prompt": "' + b"x" * (30 << 20) + b'"}'),
        ("text 20 MB", "/v1/completions", b'{"prompt": "' + b"x" * (20 << 20) + b'"}'),
        ("text 4 MB", "/v1/completions", {"prompt": "y" * (4 << 20), "max_tokens": 1}),
        ("637K token ids", "/v1/completions", {"prompt": [67] * 637_000, "max_tokens": 1}),
        ("n 128 x 2 prompts", "/v1/completions", {"prompt": ["a" * 2000] * 2, "n": 128}),
        ("tokenize 4 MB", "/v1/tokenize", {"prompt": "z" * (4 << 20)}),
        ("regex a{1000000}", "/v1/completions", {"prompt": "hi", "guided_regex": "a{1000000}"}),
        (
            "regex nested repeats",
            "/v1/completions",
            {"prompt": "hi", "guided_regex": "((a{100}){100}){100}"},
        ),
        (
            "tools 129",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
            },
        ),
    ]


class HealthPoller:
    """GET /health every `every` seconds from a thread; latencies kept with their times."""

    def __init__(self, url: str, every: float = 0.01):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=30)
        self.every, self.samples = every, []  # (start, seconds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="health-poller", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                self.client.get("/health")
            except Exception as e:  # a lost /health is a result, not a crash
                log.warning("/health failed: %s", e)
            self.samples.append((t, time.perf_counter() - t))
            self.stop.wait(self.every)

    def worst(self, t0: float, t1: float) -> float:
        """The worst latency of a poll that overlapped [t0, t1]."""
        return max((d for s, d in self.samples if s <= t1 and s + d >= t0), default=0.0)

    def __enter__(self) -> HealthPoller:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.client.close()


def lag_buckets(client, auth: dict) -> dict[float, float]:
    """The server's loop-lag histogram: upper bound (s) -> cumulative count."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics", headers=auth).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "dist_glm5_event_loop_lag_seconds":
            return {
                float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")
            }
    raise RuntimeError("the server exports no dist_glm5_event_loop_lag_seconds (an old build?)")


def worst_lag(before: dict[float, float], after: dict[float, float]) -> float:
    """The smallest bucket bound that holds every observation made between two scrapes."""
    total = after[float("inf")] - before.get(float("inf"), 0)
    for bound in sorted(after):
        if after[bound] - before.get(bound, 0) >= total:
            return 0.0 if total == 0 else bound
    return float("inf")


def _stream(client, auth: dict, prompt: str, max_tokens: int) -> tuple[str, float]:
    """An innocent greedy stream: its text and its worst gap between chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, gap, last = [], 0.0, time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body, headers=auth) as r:
        for line in r.iter_lines():
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += [c.get("text", "") for c in chunk.get("choices", [])]
    return "".join(text), gap


def run_poison(
    url: str, api_key: str | None, max_model_len: int, innocent_tokens: int = 48
) -> list[PoisonResult]:
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url, timeout=600)
    prompt = "def parse_args(argv):"
    solo, _ = _stream(client, auth, prompt, innocent_tokens)
    results = []
    with HealthPoller(url) as poller:
        for name, path, body in poison_cases(max_model_len):
            box: dict = {}

            def innocent_run(box=box):
                box["text"], box["gap"] = _stream(client, auth, prompt, innocent_tokens)

            innocent = threading.Thread(target=innocent_run)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers = {**auth, "Content-Type": "application/json"}
            lag0 = lag_buckets(client, auth)
            innocent.start()
            time.sleep(0.05)  # the stream is under way
            t0 = time.perf_counter()
            if isinstance(body, dict) and body.get("stream"):
                with client.stream("POST", path, content=content, headers=headers) as r:
                    for _ in r.iter_bytes():
                        pass
            else:
                r = client.post(path, content=content, headers=headers)
            t1 = time.perf_counter()
            innocent.join()
            lag = worst_lag(lag0, lag_buckets(client, auth))
            param = None
            if r.status_code >= 400:
                try:
                    param = json.loads(r.read()).get("error", {}).get("param")
                except ValueError:
                    param = "(not JSON)"
            results.append(
                PoisonResult(
                    name,
                    r.status_code,
                    param,
                    round(t1 - t0, 3),
                    lag * 1e3,
                    round(poller.worst(t0, t1) * 1e3, 1),
                    round(box.get("gap", float("nan")) * 1e3, 1),
                    box.get("text") == solo,
                )
            )
            log.info("%s", results[-1])
    client.close()
    return results


# ---- connection flood -----------------------------------------------------------------------


async def _flood_socket(host: str, port: int, slow: bool, closed: list, t0: float, hold: float):
    """One flood socket: idle (never sends) or slowloris (a head, a byte a second). Records when
    the server closed it."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    head = b"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nX-Slow: "
    deadline = time.monotonic() + hold
    try:
        if slow:
            writer.write(head)
        while time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(4096), 1.0)
            except asyncio.TimeoutError:
                if slow:
                    writer.write(b"a")
                    await writer.drain()
                continue
            if not data:  # the server closed it
                closed.append(time.perf_counter() - t0)
                return True
            # an answer (a 408 or a 503) before the close: read on until the close
    except (ConnectionError, OSError):
        closed.append(time.perf_counter() - t0)
        return True
    finally:
        writer.close()
    return True


def run_flood(
    url: str,
    api_key: str | None,
    idle: int = 2000,
    slowloris: int = 0,
    requests: int = 60,
    hold: float = 40.0,
) -> FloodResult:
    """Open the flood, time normal requests meanwhile, then wait (at most `hold` s from the
    start) for the server to close the flood's sockets."""
    import httpx

    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    closed: list[float] = []
    lat, statuses = [], {}
    opened = 0

    async def main():
        nonlocal opened
        t0 = time.perf_counter()
        tasks = [
            asyncio.ensure_future(_flood_socket(host, port, i < slowloris, closed, t0, hold))
            for i in range(idle + slowloris)
        ]
        await asyncio.sleep(2.0)  # the flood is open
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _time_requests)
        opened = sum(await asyncio.gather(*tasks))

    def _time_requests():
        with httpx.Client(base_url=url, timeout=30) as c:
            for i in range(requests):
                t = time.perf_counter()
                try:
                    if i % 2:
                        r = c.get("/health")
                    else:
                        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
                        r = c.post("/v1/completions", json=body, headers=auth)
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                except httpx.HTTPError as e:
                    statuses[-1] = statuses.get(-1, 0) + 1
                    log.warning("request %d failed: %s", i, e)
                lat.append(time.perf_counter() - t)

    asyncio.run(main())
    ms = sorted(x * 1e3 for x in lat)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan")
    total = idle + slowloris
    return FloodResult(
        idle,
        slowloris,
        opened,
        len(lat),
        sum(v for k, v in statuses.items() if k != 200),
        round(statistics.median(ms), 1) if ms else float("nan"),
        round(p99, 1),
        len(closed),
        round(max(closed), 1) if len(closed) == total else None,
        statuses,
    )


# ---- the command ----------------------------------------------------------------------------


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", help="the server's --api-key, if it has one")
    p.add_argument("--idle", type=int, default=2000, help="idle sockets in the flood")
    p.add_argument("--slowloris", type=int, default=500, help="slowloris sockets in the flood")
    p.add_argument("--hold", type=float, default=40.0, help="seconds the flood waits for closes")
    p.add_argument("--skip", choices=["poison", "flood"], help="leave one part out")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    parts = urlsplit(args.url)
    if parts.hostname not in ("localhost", "::1") and not parts.hostname.startswith("127."):
        # a probe is load: it is for a server on this machine (or a test host of your own)
        log.warning("probing %s: make sure it is a server of yours", parts.hostname)
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = httpx.get(args.url + "/v1/models", headers=auth, timeout=30).json()
    max_len = models["data"][0]["max_model_len"]
    out: dict = {}
    if args.skip != "poison":
        res = run_poison(args.url, args.api_key, max_len)
        out["poison"] = [asdict(r) for r in res]
        print(
            f"{'poison':34} {'status':>6} {'param':>14} {'s':>6} {'loop lag ms <=':>14} "
            f"{'/health max ms':>14} {'stream gap ms':>13} exact"
        )
        for r in res:
            print(
                f"{r.name:34} {r.status:>6} {str(r.param):>14} {r.seconds:>6.2f} "
                f"{r.loop_lag_ms:>14g} {r.health_p100_ms:>14.1f} {r.stream_gap_ms:>13.1f} "
                f"{r.stream_exact}"
            )
    if args.skip != "flood":
        f = run_flood(args.url, args.api_key, args.idle, args.slowloris, hold=args.hold)
        out["flood"] = asdict(f)
        print(
            f"flood: {f.idle} idle + {f.slowloris} slowloris ({f.opened} opened); "
            f"{f.requests} requests meanwhile: {f.failed} not 200 {f.statuses}, "
            f"p50 {f.p50_ms} ms, p99 {f.p99_ms} ms; server closed {f.closed_by_server} "
            f"of the flood's sockets, the last at {f.all_closed_s} s"
        )
    if args.json:
        print(json.dumps(out))
    return 0


socket.setdefaulttimeout(None)
