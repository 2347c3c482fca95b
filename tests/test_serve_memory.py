"""Memory stays flat over thousands of requests (issue 12): the serving process's RSS after 2,000
short requests is within 10% of its RSS after 200.

The requests go through the real application (launch/api: FastAPI, pydantic, the SSE stream, the
EngineClient, the EngineLoop, the in-process engine on the embedded model) over httpx's ASGI
transport: no sockets, so the run fits a CI budget on 2 cores. They mix completions and chat,
streamed and not, with tiny prompts and 1-2 output tokens, 16 in flight (the engine batches
them). RSS is this process's (/proc/self/statm), read after gc.collect() with the engine idle.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import httpx
from runtime_util import coordinator

FIRST, TOTAL, IN_FLIGHT = 200, 2000, 16


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def body(i: int) -> tuple[str, dict]:
    """Request i: completion or chat, streamed or not, 1 or 2 tokens, a prompt of a few bytes."""
    common = {"model": "glm5-tiny", "max_tokens": 1 + i % 2, "temperature": 0}
    if i % 4 < 2:
        return "/v1/completions", {**common, "prompt": f"r{i}", "stream": i % 4 == 1}
    msgs = [{"role": "user", "content": f"r{i}"}]
    return "/v1/chat/completions", {**common, "messages": msgs, "stream": i % 4 == 3}


async def send(client: httpx.AsyncClient, ids: range) -> None:
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        path, b = body(i)
        async with gate:
            r = await client.post(path, json=b)
        assert r.status_code == 200, (i, r.status_code, r.text[:300])
        if b["stream"]:
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-300:]
        else:
            assert r.json()["usage"]["completion_tokens"] == b["max_tokens"]

    await asyncio.gather(*(one(i) for i in ids))


def test_rss_after_2000_short_requests_is_within_10_percent_of_after_200(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.model.config import ModelConfig

    c = coordinator(default_model_dir, max_model_len=2048, microbatches=1)
    loop = EngineLoop(c)
    client = EngineClient(loop, max_waiters=64)
    vocab = ModelConfig.from_hf(default_model_dir).vocab_size
    model = ModelInfo.from_model_dir(default_model_dir, "glm5-tiny", 2048, vocab, c.tokenizer)
    app = build_app(client, model)

    def settle() -> float:
        for _ in range(200):  # the release of the last requests rides the next (empty) plan
            if not c.has_work:
                break
            time.sleep(0.05)
        gc.collect()
        return rss_mb()

    async def run() -> tuple[float, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            await send(http, range(FIRST))
            after_first = settle()
            await send(http, range(FIRST, TOTAL))
            return after_first, settle()

    try:
        t = time.perf_counter()
        first, last = asyncio.run(run())
        took = time.perf_counter() - t
        s = c.scheduler
        assert not loop.live and not s.by_id and not s.running and not s.waiting
        assert not s.block_manager.tables and not c.pipeline.worker.cache.tables
        assert loop.metrics_snapshot().e2e.count == TOTAL
        assert last <= 1.10 * first, (
            f"RSS {first:.1f} MB after {FIRST} requests, {last:.1f} MB after {TOTAL} "
            f"({(last - first) * 2**10 / (TOTAL - FIRST):.1f} KB per request; {took:.0f} s)"
        )
    finally:
        client.close()
        loop.close()
