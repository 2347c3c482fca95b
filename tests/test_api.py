"""The OpenAI server (launch/api/) on a real uvicorn over the embedded model, in this process:
the official openai client's happy paths, a 400 naming the field for every malformed value while
another client's stream goes on, the API key, disconnects aborting, an engine failure failing one
request, /metrics and /openapi.json."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from conftest import require
from runtime_util import coordinator, wait_until

from dist_glm5.stages.worker import StageWorker

openai = require("openai")
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
POISON = [255, 254, 253, 252]  # a prompt starting so fails inside the engine (FailingWorker)
CTX = 2048


class FailingWorker(StageWorker):
    def step(self, plan):
        if any(w.start == 0 and w.tokens[:4] == POISON for w in plan.work):
            raise RuntimeError("injected failure")
        return super().step(plan)


@pytest.fixture(scope="module")
def server(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.launch.api.server import HttpServer, ServerSettings
    from dist_glm5.model.config import ModelConfig

    c = coordinator(default_model_dir, worker_cls=FailingWorker, max_model_len=CTX)
    loop = EngineLoop(c)
    handles = []  # every engine request, to watch how it ends
    submit = loop.submit
    loop.submit = lambda *a, **kw: handles.append(submit(*a, **kw)) or handles[-1]
    client = EngineClient(loop)
    vocab = ModelConfig.from_hf(default_model_dir).vocab_size
    # the edge believes in a slightly longer context than the engine's, so that a prompt between
    # the two reaches the engine and is refused there (its ValueError at admission)
    model = ModelInfo.from_model_dir(default_model_dir, "glm5-tiny", CTX + 64, vocab, c.tokenizer)
    srv = HttpServer(build_app(client, model, KEY), ServerSettings(port=0)).start()
    srv.handles = handles
    srv.loop = loop
    yield srv
    srv.stop()
    client.close()
    loop.close()


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body: bytes, headers=AUTH):
    h = {"Content-Type": "application/json", **headers}
    return httpx.post(server.url + path, content=body, headers=h, timeout=60)


def test_openai_client_streams_reassemble_to_the_answer(oc):
    assert [m.id for m in oc.models.list().data] == ["glm5-tiny"]
    kw = dict(model="glm5-tiny", prompt="Hello", max_tokens=12, temperature=0)
    whole = oc.completions.create(**kw)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    chunks = list(oc.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    # usage in its own last chunk with no choices, as OpenAI sends it
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = oc.chat.completions.create(model="glm5-tiny", messages=msgs, max_tokens=9, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 9
    parts = list(
        oc.chat.completions.create(
            model="glm5-tiny", messages=msgs, max_tokens=9, temperature=0, stream=True
        )
    )
    assert parts[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in parts)
    assert text == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"
    # content as text parts is the same chat
    as_parts = [
        {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in msgs
    ]
    again = oc.chat.completions.create(
        model="glm5-tiny", messages=as_parts, max_tokens=9, temperature=0
    )
    assert again.choices[0].message.content == chat.choices[0].message.content


BAD = [  # (path, body, the field the 400 must name; None: the body itself)
    ("c", {"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    ("c", {"stop_token_ids": "5"}, "stop_token_ids"),
    ("c", {"stop_token_ids": [100000]}, "stop_token_ids"),
    ("c", {"bad_words": [["a"]]}, "bad_words.0"),
    ("c", {"bad_words": [[1.5]]}, "bad_words.0"),
    ("c", {"seed": 1.5}, "seed"),
    ("c", {"seed": "abc"}, "seed"),
    ("c", {"seed": 2**64}, "seed"),
    ("c", {"seed": -1}, "seed"),
    ("c", {"top_k": 2.5}, "top_k"),
    ("c", {"logprobs": 2.5}, "logprobs"),
    ("c", {"logprobs": 21}, "logprobs"),
    ("c", {"stop": [1, 2]}, "stop"),
    ("c", {"stop": ""}, "stop"),
    ("c", {"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
    ("c", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("c", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("c", {"max_tokens": 0}, "max_tokens"),
    ("c", {"max_tokens": -1}, "max_tokens"),
    ("c", {"temperature": "0.5"}, "temperature"),
    ("c", {"temperature": 3}, "temperature"),
    ("c", {"top_p": 0}, "top_p"),
    ("c", {"stream": "false"}, "stream"),
    ("c", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("c", {"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ("c", {"n": 0}, "n"),
    ("c", {"n": 129}, "n"),
    ("c", {"prompt": ["a"] * 100, "n": 3}, "prompt"),  # 300 choices
    ("c", {"best_of": 2}, "best_of"),  # known, not supported: named, never ignored
    ("c", {"suffix": "x"}, "suffix"),
    ("c", {"use_beam_search": True}, "use_beam_search"),
    ("c", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("c", {"repetition_penalty": 0}, "repetition_penalty"),
    ("c", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("c", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("c", {"guided_regex": "(("}, "guided_regex"),
    ("c", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("c", {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ("c", {"prompt": [1, 2, 100000]}, "prompt"),
    ("c", {"prompt": [1.5]}, "prompt"),
    ("c", {"prompt": ""}, "prompt"),
    ("c", {"prompt": ["a", ""]}, "prompt"),
    ("c", {"prompt": [[1], []]}, "prompt"),
    ("c", {"prompt": "x" * (CTX + 64)}, "prompt"),
    ("c", {"prompt": "x" * 100, "max_tokens": CTX}, "max_tokens"),
    ("c", {"prompt": None}, "prompt"),
    ("m", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("m", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("m", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (
        "m",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages.0.content",
    ),
    ("m", {"messages": []}, "messages"),
    (
        "m",
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
        "messages.0.tool_calls.0.id",
    ),
    ("m", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("m", {"top_logprobs": 2}, "top_logprobs"),
    ("m", {"echo": True}, "echo"),
    ("m", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    (
        "m",
        {
            "messages": [{"role": "user", "content": "x", "tool_call_id": "a"}],
            "continue_final_message": True,
        },
        "continue_final_message",
    ),
    ("m", {"logprobs": "yes"}, "logprobs"),
]
RAW = [  # bodies that are not JSON objects at all
    b"\xff\xfe{}",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": "\\ud800"}',
    b"{not json",
    b"",
    b"[1, 2]",
    b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
]


def test_each_malformed_value_is_a_400_naming_the_field_while_a_stream_goes_on(server, oc):
    kw = dict(model="glm5-tiny", prompt="A stream that must not notice.", max_tokens=40)
    want = oc.completions.create(**kw, temperature=0).choices[0].text
    streamed = []

    def stream():
        for c in oc.completions.create(**kw, temperature=0, stream=True):
            streamed.append(c.choices[0].text)

    t = threading.Thread(target=stream)
    t.start()
    for path, fields, param in BAD:
        if path == "c":
            body = {"model": "glm5-tiny", "prompt": "hi", "max_tokens": 2, **fields}
            url = "/v1/completions"
        else:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
            url = "/v1/chat/completions"
        r = post(server, url, json.dumps(body).encode())
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param.split(".")[0] in err["message"], (fields, err)
        assert err["type"] == "invalid_request_error"
    for raw in RAW:
        r = post(server, "/v1/completions", raw)
        assert r.status_code == 400 and r.json()["error"]["message"], (raw[:40], r.text)
    r = post(server, "/v1/completions", b'{"prompt": "\\ud800x", "max_tokens": 2}')
    assert r.json()["error"]["param"] == "prompt"
    t.join(timeout=60)
    assert "".join(streamed) == want  # the other client's stream, untouched
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    # still serving: three tokens (unseeded sampling may draw <eos> first, as it once did in CI)
    ok = oc.completions.create(
        model="glm5-tiny", prompt="ok", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 3


def test_fields_unknown_to_openai_and_vllm_are_accepted(server, caplog):
    body = {"prompt": "hi", "max_tokens": 2, "my_trace_id": "abc"}
    r = post(server, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text
    assert "my_trace_id" in caplog.text


def test_context_limit_and_engine_refusal_are_400s_that_say_the_limit(server):
    r = post(server, "/v1/completions", json.dumps({"prompt": "x" * 3000}).encode())
    assert r.status_code == 400 and str(CTX + 64) in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # past the edge's check, refused by the engine at admission
    r = post(server, "/v1/completions", json.dumps({"prompt": "x" * (CTX + 10)}).encode())
    assert r.status_code == 400 and str(CTX) in r.json()["error"]["message"], r.text


def test_protocol_errors_are_400s_and_serving_goes_on(server):
    def raw(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(request)
            return s.recv(4096)

    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    assert raw((head + "Content-Length: abc\r\n\r\n{}").encode()).startswith(b"HTTP/1.1 400")
    assert raw((head + "Content-Length: -5\r\n\r\n{}").encode()).startswith(b"HTTP/1.1 400")
    big = (head + f"Content-Length: {64 << 20}\r\n\r\n").encode()
    assert raw(big).startswith(b"HTTP/1.1 413")
    # a 401 on a keep-alive connection: its unread body is never taken for the next request
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        body = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert _read_response(s).startswith(b"HTTP/1.1 401")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        second = _read_response(s)
        assert second == b"" or second.startswith(b"HTTP/1.1 200"), second
    assert httpx.get(server.url + "/health").status_code == 200


def _read_response(s: socket.socket) -> bytes:
    """One whole response (head and Content-Length body), or b"" when the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(4096)
        if not more:
            return data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = [
        int(v)
        for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:])
        if k.strip().lower() == b"content-length"
    ]
    while len(body) < (length[0] if length else 0):
        body += s.recv(4096)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY} extra"},
    ],
    ids=["none", "wrong", "empty", "no-scheme", "basic", "trailing"],
)
def test_api_key_on_every_endpoint_but_health(server, headers):
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/nope"),
    ]:
        r = httpx.request(method, server.url + path, headers=headers, content=b"{bad")
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def _engine_request_for(server, n_before: int, timeout=30.0):
    def reached():
        return len(server.handles) > n_before and server.handles[n_before].seq is not None

    wait_until(reached, timeout, "the request never reached the engine")
    return server.handles[n_before]


def _wait_finished(handle, timeout=30.0):
    wait_until(lambda: handle.seq.finished, timeout, "the request kept generating")
    return handle.seq


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts_the_request(server, oc, stream):
    n = len(server.handles)
    body = {"prompt": "Go on for a long time.", "max_tokens": 1500, "temperature": 0}
    body["stream"] = stream
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        h = _engine_request_for(server, n)
        while len(h.seq.output) < 5:  # generating
            time.sleep(0.01)
    seq = _wait_finished(h)
    assert seq.finish_reason == "abort" and len(seq.output) < 500, (
        seq.finish_reason,
        len(seq.output),
    )

    # nothing else runs: its blocks are back in the ledger
    def idle():
        m = server.loop.metrics_snapshot()
        return not (m.running or m.cache_usage)

    wait_until(idle, 5, "the aborted request still holds the engine or its blocks")
    assert oc.completions.create(model="glm5-tiny", prompt="next", max_tokens=2).choices


def _wait_healthy(server, seconds: float = 60.0) -> None:
    def healthy():
        return httpx.get(server.url + "/health").status_code == 200

    wait_until(healthy, seconds, "the engine did not come back after a failure", every=0.1)


def test_a_request_that_fails_in_the_engine_gets_a_500_and_the_others_go_on(server, oc):
    r = post(server, "/v1/completions", json.dumps({"prompt": POISON, "max_tokens": 3}).encode())
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"], r.text
    _wait_healthy(server)  # while the pipeline restarts a request is a 503 (test_stage_faults)
    r = post(
        server,
        "/v1/completions",
        json.dumps({"prompt": POISON, "max_tokens": 3, "stream": True}).encode(),
    )
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    # the failure is told before the pipeline restarts: /health is 503 until it has
    _wait_healthy(server)
    assert oc.completions.create(model="glm5-tiny", prompt="fine", max_tokens=3).choices


def test_metrics_parse_and_have_the_histograms(server, oc):
    from prometheus_client.parser import text_string_to_metric_families

    oc.completions.create(model="glm5-tiny", prompt="count me", max_tokens=4)
    r = httpx.get(server.url + "/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "dist_glm5_time_to_first_token_seconds",
        "dist_glm5_inter_token_latency_seconds",
        "dist_glm5_e2e_request_latency_seconds",
        "dist_glm5_request_queue_time_seconds",
    ):
        assert fams[name].type == "histogram", name
        count = [s.value for s in fams[name].samples if s.name == name + "_count"]
        assert count and count[0] > 0, name
    for name in (
        "dist_glm5_num_requests_running",
        "dist_glm5_num_requests_waiting",
        "dist_glm5_num_requests_preempted",
        "dist_glm5_queue_length",
        "dist_glm5_num_preemptions",
        "dist_glm5_kv_cache_usage_ratio",
        "dist_glm5_stage_busy_seconds",
        "dist_glm5_mtp_draft_tokens",
        "dist_glm5_mtp_acceptance_ratio",
        "dist_glm5_request_success",
        "dist_glm5_generation_tokens",
    ):
        assert name in fams, name
    busy = [s for s in fams["dist_glm5_stage_busy_seconds"].samples if s.labels["stage"] == "0"]
    assert busy and busy[0].value > 0


def test_openapi_schema_is_served(server):
    r = httpx.get(server.url + "/openapi.json", headers=AUTH)
    schema = r.json()
    assert r.status_code == 200 and schema["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"):
        assert path in schema["paths"], path
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "stop", "logit_bias", "seed"} <= set(props)
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


def _fuzz(server, op, examples: int, seen: dict[int, int]):
    from hypothesis import HealthCheck, given, settings

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same draws every run: a failure here is never a fluke
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy())
    def run(case):
        if isinstance(case.body, dict):
            for k in ("max_tokens", "max_completion_tokens"):
                if type(case.body.get(k)) is int and case.body[k] > 4:
                    case.body[k] = 4
            if "messages" in case.body and "max_tokens" not in case.body:
                case.body["max_tokens"] = 4
        r = case.call(base_url=server.url, headers=AUTH, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (op.path, case.body, r.text[:300])

    return run


def test_property_based_run_against_the_openapi_schema_has_no_5xx(server):
    """schemathesis draws requests from our own /openapi.json (bounded: a few dozen per
    operation, outputs capped at 4 tokens so a valid draw costs one short generation)."""
    schemathesis = require("schemathesis")

    spec = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    seen: dict[int, int] = {}
    for result in schemathesis.openapi.from_dict(spec).get_all_operations():
        op = result.ok()
        _fuzz(server, op, 40 if op.method.upper() == "POST" else 5, seen)()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both valid and invalid draws
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("status", ["restarting", "dead"])
def test_health_is_503_while_the_engine_cannot_serve(status):
    from fastapi.testclient import TestClient

    from dist_glm5.engine.loop import EngineState
    from dist_glm5.engine.metrics import EngineMetrics
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo

    class Stuck:  # the engine loop's health and metrics, in the given state
        max_model_len = 64

        def health(self):
            return EngineState(status, "pipeline restart failed: OSError")

        def metrics_snapshot(self):
            return EngineMetrics()

    client = EngineClient(Stuck(), max_waiters=1)
    with TestClient(build_app(client, ModelInfo("m", 64, 10), api_key=KEY)) as t:
        r = t.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert status in r.json()["detail"] and "OSError" in r.json()["detail"]
        assert t.get("/metrics", headers=AUTH).status_code == 200
    client.close()
