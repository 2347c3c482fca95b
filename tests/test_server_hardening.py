"""No client and no request stalls the server (issue: server-hardening), on a real uvicorn over the
embedded model with small limits: idle and slowloris sockets are closed and shed before requests
suffer; a stalled or oversized body is a 408 or 413 in OpenAI's shape; every list field is bounded
by a limit that a 400 names with its flag; poison requests leave an innocent stream exact; 500s
carry no internals; /v1/models/{id}, HEAD /health and no slash redirects."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from conftest import require
from runtime_util import coordinator

from dist_glm5.launch.api.limits import Limits

openai = require("openai")
CTX = 4096
LIMITS = Limits(
    max_connections=48,
    header_timeout=1.0,
    keep_alive_timeout=1.0,
    max_body_bytes=1 << 20,
    body_timeout=1.0,
    max_prompt_chars=64 << 10,
    max_choices=4,
    max_stop=8,
    max_bad_words=16,
    max_logit_bias=16,
    max_tools=4,
)


@pytest.fixture(scope="module")
def server(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.launch.api.server import HttpServer, ServerSettings
    from dist_glm5.model.config import ModelConfig

    c = coordinator(default_model_dir, max_model_len=CTX)
    loop = EngineLoop(c)
    client = EngineClient(loop)
    vocab = ModelConfig.from_hf(default_model_dir).vocab_size
    model = ModelInfo.from_model_dir(default_model_dir, "glm5-tiny", CTX, vocab, c.tokenizer)
    settings = ServerSettings(port=0, limits=LIMITS)
    srv = HttpServer(build_app(client, model, limits=LIMITS), settings).start()
    yield srv
    srv.stop()
    client.close()
    loop.close()


def _addr(server) -> tuple[str, int]:
    return "127.0.0.1", server.port


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (from now)."""
    sock.settimeout(timeout)
    t0, data = time.monotonic(), b""
    while True:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return data, float("inf")
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def _error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)["error"]


def _complete(server, **body) -> httpx.Response:
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


# ---- sockets --------------------------------------------------------------------------------


def test_idle_sockets_are_shed_and_closed_while_requests_go_on(server):
    """Twice the connection cap in idle sockets: requests still succeed (the oldest idle
    sockets are closed to make room), and every idle socket is closed within the head
    timeout."""
    stats = server.stats
    evicted0, timeouts0 = stats.evicted, stats.head_timeouts
    idle = [socket.create_connection(_addr(server)) for _ in range(2 * LIMITS.max_connections)]
    try:
        statuses = [httpx.get(server.url + "/health", timeout=10).status_code for _ in range(5)]
        statuses.append(_complete(server).status_code)
        assert statuses == [200] * 6
        assert stats.evicted > evicted0  # shed to make room, not refused
        closed = [_read_all(s, LIMITS.header_timeout + 5) for s in idle]
        assert all(data == b"" for data, _ in closed)  # idle sockets closed without a word
        # each closed by the server (inf: our read's window, a hang guard, ran out first)
        assert all(t < float("inf") for _, t in closed), closed
        assert stats.head_timeouts > timeouts0
    finally:
        for s in idle:
            s.close()


def test_a_slowloris_head_is_cut_off_with_a_408(server):
    s = socket.create_connection(_addr(server))
    t0 = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    sent, cut_off = 0, False
    try:  # a byte every 0.2 s: each byte must not extend the deadline
        while time.monotonic() - t0 < LIMITS.header_timeout + 3:
            s.sendall(b"X-Slow: a\r\n"[sent % 11 : sent % 11 + 1])
            sent += 1
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        cut_off = True
    data, _ = _read_all(s, 5)
    s.close()
    status, err = _error(data)
    assert status == 408 and err["code"] == "header_timeout", err
    # the server hung up on a client still sending its head: the bytes never bought more time
    assert cut_off, f"the connection stayed open through {sent} header bytes"


def test_a_kept_alive_connection_is_closed_after_its_idle_timeout(server):
    s = socket.create_connection(_addr(server))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    _, closed_after = _read_all(s, LIMITS.keep_alive_timeout + 5)
    s.close()
    # the server closed it (our read's window is only a hang guard), and not before its timeout
    assert LIMITS.keep_alive_timeout - 1 <= closed_after < float("inf"), closed_after


def test_a_stalled_body_is_a_408_and_a_large_one_a_413_in_openais_shape(server):
    s = socket.create_connection(_addr(server))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    data, _ = _read_all(s, LIMITS.body_timeout + 5)
    s.close()
    status, err = _error(data)
    assert status == 408 and "--body-timeout" in err["message"], err
    big = b'{"prompt": "' + b"x" * LIMITS.max_body_bytes + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(LIMITS.max_body_bytes // 65536 + 2):
            yield b"x" * 65536

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_malformed_request_line_is_a_400_in_openais_shape(server):
    s = socket.create_connection(_addr(server))
    s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
    data, _ = _read_all(s, 5)
    s.close()
    status, err = _error(data)
    assert status == 400 and err["type"] == "invalid_request_error"


# ---- one request's fields -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("bad_words", [f"w{i}" for i in range(40_000)], "--max-bad-words"),
        ("stop", ["s"] * 100_000, "--max-stop"),
        ("logit_bias", {str(i): 1.0 for i in range(200)}, "--max-logit-bias"),
        ("n", 3, "--max-choices"),  # 2 prompts x 3
        ("prompt", "x" * (LIMITS.max_prompt_chars + 1), "--max-prompt-chars"),
    ],
)
def test_every_list_is_bounded_by_a_limit_the_400_names(server, field, value, flag):
    body = {"prompt": ["a", "b"]} if field == "n" else {}
    r = _complete(server, **body, **{field: value})
    err = r.json()["error"]
    assert r.status_code == 400 and flag in err["message"], err
    assert err["param"] == field


def test_chat_tools_and_messages_are_bounded(server):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_duplicate_list_entries_count_against_the_limit_then_fold(server):
    """A limit counts the entries as sent (what the request costs to parse); within it,
    duplicates fold in linear time and change nothing."""
    r = _complete(server, stop=["zz"] * 10_000)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    once = _complete(server, stop=["zz", "yy"], bad_words=["qq"]).json()["choices"][0]["text"]
    r = _complete(server, stop=["zz", "zz", "yy"], bad_words=["qq"] * 3)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == once, r.text


def test_poison_requests_leave_an_innocent_stream_exact(server):
    """Each poison request runs beside a greedy stream: the stream's text equals its solo run,
    /health keeps answering, and the poison gets its status. (`bench probe-server` measures
    the stall in ms; here a loose bound catches a return of the 33 s freeze.)"""
    from dist_glm5.bench.probe_server import HealthPoller, _stream

    poison = [
        ({"prompt": "hi", "bad_words": [f"w{i}" for i in range(40_000)]}, 400),
        ({"prompt": [65] * 2000, "max_tokens": 1, "prompt_logprobs": 20}, 200),
        (
            {"prompt": [66] * 2000, "max_tokens": 1, "echo": True, "logprobs": 5, "stream": True},
            200,
        ),
        ({"prompt": "y" * (LIMITS.max_prompt_chars - 10), "max_tokens": 1}, 400),  # > context
    ]
    client = httpx.Client(base_url=server.url, timeout=120)
    solo, _ = _stream(client, {}, "def parse_args(argv):", 24)
    with HealthPoller(server.url) as poller:
        for body, status in poison:
            box: dict = {}

            def innocent(box=box):
                box["text"], box["gap"] = _stream(client, {}, "def parse_args(argv):", 24)

            t = threading.Thread(target=innocent)
            t.start()
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            t1 = time.perf_counter()
            t.join()
            assert r.status_code == status, (list(body), r.text[:300])
            assert box["text"] == solo
            assert poller.worst(t0, t1) < 2.0, list(body)
    client.close()


# ---- errors and routes ----------------------------------------------------------------------


def test_a_500_names_the_request_id_and_no_internals(default_model_dir):
    from fastapi.testclient import TestClient

    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.launch.api.errors import public

    class Idle:
        max_model_len = 64

    app = build_app(EngineClient(Idle(), max_waiters=1), ModelInfo("m", 64, 10))

    @app.get("/boom")
    def boom():
        raise RuntimeError("secret detail at /opt/build/torch/lib/x.py")

    with TestClient(app, raise_server_exceptions=False) as t:
        r = t.get("/boom", headers={"X-Request-Id": "abc123"})
    err = r.json()["error"]
    assert r.status_code == 500 and "abc123" in err["message"], err
    assert "secret" not in err["message"] and "/opt" not in err["message"]
    gloo = (
        "stage 1 rank 0 failed: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:41234"
    )
    assert public(gloo) == "stage 1 rank 0 failed: Connection closed by peer [127.0.0.1]:41234"


def test_models_retrieve_head_health_and_no_slash_redirect(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert oc.models.retrieve("glm5-tiny").id == "glm5-tiny"
    with pytest.raises(openai.NotFoundError):
        oc.models.retrieve("gpt-4")
    assert httpx.head(server.url + "/health").status_code == 200
    r = httpx.get(server.url + "/v1/models/", headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---- the engine down ------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["restarting", "dead"])
def test_a_request_while_the_engine_cannot_serve_is_a_503_at_once(status):
    from fastapi.testclient import TestClient

    from dist_glm5.engine.loop import EngineState
    from dist_glm5.engine.metrics import EngineMetrics
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo

    class Down:
        max_model_len = 64

        def health(self):
            why = "stage 1 rank 0 failed: [/src/gloo/pair.cc:534] Connection closed by peer"
            return EngineState(status, why)

        def metrics_snapshot(self):
            return EngineMetrics()

        def submit(self, *a, **kw):
            raise AssertionError("nothing is submitted while the engine is down")

    with TestClient(build_app(EngineClient(Down(), max_waiters=1), ModelInfo("m", 64, 10))) as t:
        r = t.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert err["code"] == "engine_unavailable" and "stage 1 rank 0" in err["message"]
    assert "pair.cc" not in err["message"]


def test_queued_requests_fail_when_a_restart_fails_instead_of_waiting(default_model_dir):
    """A stage failure fails the started request; the restart then fails too: the queued
    request hears that at once (not after every attempt's startup timeout)."""
    from dist_glm5.engine import loop as el
    from dist_glm5.sampling.params import SamplingParams
    from dist_glm5.stages.worker import StageWorker

    class Fails(StageWorker):
        def step(self, plan):
            raise RuntimeError("injected failure")

    c = coordinator(default_model_dir, worker_cls=Fails, max_seqs=1)

    def cannot(why):
        raise OSError("no node can take stage 0")

    c.restart = cannot
    attempts, el.RESTART_ATTEMPTS = el.RESTART_ATTEMPTS, 1
    loop = el.EngineLoop(c)
    try:
        p = SamplingParams(max_tokens=4)
        started = loop.submit([65, 66, 67], p)
        queued = loop.submit([68, 69, 70], p)
        kinds = [h.events.get(timeout=30) for h in (started, queued)]
    finally:
        el.RESTART_ATTEMPTS = attempts
        loop.close()
    assert kinds[0][0] == "error" and "injected failure" in kinds[0][1], kinds[0]
    assert kinds[1][0] == "error" and "restart failed" in kinds[1][1], kinds[1]
