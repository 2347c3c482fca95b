"""Tool calls through the official openai client against a real server (uvicorn on a free port,
one per module) over the random model: the matrix tool_choice {none, auto, required, named} x
{stream, non-stream} x {one tool, several, parallel calls, nested-object arguments, strings with
quotes/newlines/unicode} (40 cells, all sent at once so the engine batches them).

What each cell can show with a random model, honestly:
- required / named: the grammar forces the call, so every cell checks the parsed calls (names,
  argument JSON validating against the function's schema with `jsonschema`), the finish reason
  "tool_calls", and that the streamed deltas reassemble to the non-streamed answer.
- none / auto: a random model never writes `<tool_call>`, so these cells check that no call is
  invented, the finish reason, and that auto's content is none's (same prompt, greedy). That the
  auto path does parse calls is shown on a scripted engine (a fake loop that writes crafted GLM
  text, malformed and truncated calls included) through the same server code and client.
Also: `role: "tool"` messages fed back, and a GLM-style jinja template rendering tools and calls.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from conftest import require
from runtime_util import coordinator

from dist_glm5.engine.config import CacheConfig

openai = require("openai")

WX = {
    "name": "wx",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
    },
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
NEST = {
    "name": "nest",
    "parameters": {
        "type": "object",
        "properties": {
            "at": {
                "type": "object",
                "properties": {
                    "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                    "tag": {
                        "type": "object",
                        "properties": {"k": {"enum": ["a", "b"]}},
                        "required": ["k"],
                        "additionalProperties": False,
                    },
                },
                "required": ["lat", "tag"],
                "additionalProperties": False,
            }
        },
        "required": ["at"],
        "additionalProperties": False,
    },
}
NOTE = {
    "name": "note",
    "parameters": {
        "type": "object",
        "properties": {
            "text": {"type": "string", "enum": ['say "hi"\\', "two\nlines", "Zürich ☃ 東京"]},
            "tags": {"type": "array", "items": {"enum": ["<x>", "y'z"]}, "maxItems": 2},
        },
        "required": ["text", "tags"],
        "additionalProperties": False,
    },
}
# variant -> (tools, the function a named choice names, extra request fields)
VARIANTS = {
    "one": ([WX], "wx", {"parallel_tool_calls": False}),
    "several": ([WX, ADD, NOTE], "add", {"parallel_tool_calls": False}),
    # min_tokens holds EOS back until a second call has begun (one call is < 120 bytes), then
    # a bias ends the answer where the grammar first allows: exactly two calls ("required"; a
    # named function is called once, whatever min_tokens says)
    "parallel": (
        [ADD, WX],
        "add",
        {"extra_body": {"min_tokens": 120}, "max_tokens": 300, "logit_bias": {"257": 100}},
    ),
    "nested": ([NEST], "nest", {"parallel_tool_calls": False}),
    "strings": ([NOTE], "note", {"parallel_tool_calls": False}),
}
CHOICES = ["none", "auto", "required", "named"]
MODEL = "glm5-tiny"


def tools_of(variant):
    return [{"type": "function", "function": f} for f in VARIANTS[variant][0]]


def request(variant, choice):
    fns, named, extra = VARIANTS[variant]
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"use {variant}"}],
        tools=tools_of(variant),
        temperature=0,
        max_tokens=200,
    )
    kw.update(extra)
    if choice == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": named}}
    else:
        kw["tool_choice"] = choice
    if choice in ("none", "auto"):  # free text: a few tokens say what is to be said
        kw["max_tokens"] = 6
        kw.pop("extra_body", None)
        kw.pop("logit_bias", None)
    return kw


def start_server(loop, model_info):
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.server import HttpServer, ServerSettings

    client = EngineClient(loop)
    srv = HttpServer(build_app(client, model_info), ServerSettings(port=0)).start()
    srv.client = client
    return srv


@pytest.fixture(scope="module")
def server(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.model.config import ModelConfig

    c = coordinator(default_model_dir, cache=CacheConfig(256), max_model_len=2048)
    loop = EngineLoop(c)
    vocab = ModelConfig.from_hf(default_model_dir).vocab_size
    srv = start_server(
        loop, ModelInfo.from_model_dir(default_model_dir, MODEL, 2048, vocab, c.tokenizer)
    )
    yield srv
    srv.stop()
    srv.client.close()
    loop.close()


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def answer(oc, kw, stream):
    """(content, [(id, name, arguments)], finish_reason), from the JSON answer or reassembled
    from the stream's deltas as a client does (content concatenated, each call's fields by its
    index)."""
    if not stream:
        r = oc.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason
    content, calls, reason = [], [], None
    for ch in oc.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            content.append(c.delta.content or "")
            for d in c.delta.tool_calls or []:
                if d.index == len(calls):  # a new call
                    calls.append(["", "", ""])
                calls[d.index][0] += d.id or ""
                calls[d.index][1] += d.function.name or ""
                calls[d.index][2] += d.function.arguments or ""
            reason = c.finish_reason or reason
    text = "".join(content)
    return (text or None) if calls else text, [tuple(c) for c in calls], reason


def run_cell(oc, variant, choice, stream):
    return answer(oc, request(variant, choice), stream)


@pytest.fixture(scope="module")
def cells(oc):
    """Every cell at once (the engine batches them): (variant, choice, stream) -> answer."""
    keys = list(itertools.product(VARIANTS, CHOICES, [False, True]))
    with ThreadPoolExecutor(len(keys)) as ex:
        futures = {k: ex.submit(run_cell, oc, *k) for k in keys}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tool_call_matrix(cells, variant, choice, stream):
    content, calls, reason = cells[(variant, choice, stream)]
    other = cells[(variant, choice, not stream)]
    # streamed deltas reassemble to the non-streamed answer (call ids are fresh per answer)
    assert (content, [c[1:] for c in calls], reason) == (
        other[0],
        [c[1:] for c in other[1]],
        other[2],
    )
    fns, named, _ = VARIANTS[variant]
    schemas = {f["name"]: f["parameters"] for f in fns}
    if choice in ("none", "auto"):
        assert calls == [] and reason == "length" and isinstance(content, str)
        # the weak model writes no call, so auto's answer is none's, parsed and found plain
        assert content == cells[(variant, "none", stream)][0]
        return
    assert reason == "tool_calls" and content is None, (reason, content)
    # a named tool_choice is exactly one call (as OpenAI and vLLM); "required" may be several
    assert len(calls) == (2 if variant == "parallel" and choice == "required" else 1)
    assert len({c[0] for c in calls}) == len(calls) and all(c[0].startswith("call_") for c in calls)
    for _, name, args in calls:
        assert name in schemas and (choice == "required" or name == named)
        jsonschema.validate(json.loads(args), schemas[name])
    if variant == "strings":  # quotes, a backslash, a newline, non-ASCII: exact after JSON
        assert json.loads(calls[0][2])["text"] in NOTE["parameters"]["properties"]["text"]["enum"]


def test_tool_messages_are_fed_back(server, oc):
    import httpx

    args = json.dumps({"city": "Zürich", "days": 2}, ensure_ascii=False)
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "wx", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = httpx.post(server.url + "/v1/tokenize", json={"messages": msgs, "tools": tools_of("one")})
    text = httpx.post(server.url + "/v1/detokenize", json={"tokens": r.json()["tokens"]})
    text = text.json()["prompt"]
    assert '"name": "wx"' in text  # the tools, listed
    assert (
        "<tool_call>wx<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    ) in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|assistant|>\n")
    ans = oc.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools_of("one"), max_tokens=3, temperature=0
    )
    assert ans.usage.prompt_tokens == r.json()["count"]
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2},
    )
    assert bad.status_code == 400 and "tool_call_id" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "wx"}}] * 2}, "tools"),
        (
            {
                "tools": tools_of("one"),
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        (
            {
                "tools": tools_of("one"),
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"tools": tools_of("one"), "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "x"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param):
    import httpx

    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body},
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


# ---- the auto path on a scripted engine --------------------------------------------------------
SCRIPT = {
    "call": 'Checking.<tool_call>wx<arg_key>city</arg_key><arg_value>Zürich "Nord"\nA'
    "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    "parallel": "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b"
    "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>wx<arg_key>city"
    "</arg_key><arg_value>東京</arg_value><arg_key>days</arg_key><arg_value>1"
    "</arg_value></tool_call>",
    "malformed": "a <tool_call>nope<arg_key>x</arg_key><arg_value>1</arg_value></tool_call> b",
    "truncated": "ok <tool_call>wx<arg_key>city</arg_key><arg_val",
}
PARSED = {
    "call": ("Checking.", [("wx", {"city": 'Zürich "Nord"\nA', "days": 3})], "tool_calls"),
    "parallel": (
        None,
        [("add", {"a": 1, "b": 2}), ("wx", {"city": "東京", "days": 1})],
        "tool_calls",
    ),
    "malformed": (SCRIPT["malformed"], [], "stop"),
    "truncated": (SCRIPT["truncated"], [], "stop"),
}


class ScriptedLoop:
    """The engine loop's contract (engine/loop.py), writing SCRIPT[the user's message]
    a few UTF-8 bytes per delta (so tags and characters split across deltas)."""

    max_model_len = 4096

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def submit(self, prompt, params, request_id=None):
        from dist_glm5.engine.loop import Delta, Handle

        h = Handle(request_id)
        text = self.tok.decode(prompt)
        key = next(k for k in SCRIPT if f"|user|>\n{k}\n" in text)
        data = SCRIPT[key].encode()
        # the text as the engine's detokenizer would release it: whole characters only
        pieces, buf = [], b""
        for i in range(0, len(data), 3):
            buf += data[i : i + 3]
            try:
                pieces.append(buf.decode())
                buf = b""
            except UnicodeDecodeError:
                pieces.append("")
        events = [Delta(list(data[i * 3 : i * 3 + 3]), p) for i, p in enumerate(pieces)]
        for d in events:
            h.events.put(("delta", d))
        seq = type(
            "Seq",
            (),
            {"output": list(data), "finish_reason": "stop", "logprobs": [], "prompt_logprobs": []},
        )()
        h.events.put(("done", seq))
        return h

    def abort(self, handle):
        pass

    def health(self):
        from dist_glm5.engine.loop import EngineState

        return EngineState("ok")

    def metrics_snapshot(self):
        from dist_glm5.engine.metrics import EngineMetrics

        return EngineMetrics()


@pytest.fixture(scope="module")
def scripted():
    from dist_glm5.checkpoint.tokenizer import ByteTokenizer
    from dist_glm5.launch.api.engine_request import ModelInfo

    tok = ByteTokenizer()
    srv = start_server(ScriptedLoop(tok), ModelInfo(MODEL, 4096, 259, tok))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    srv.stop()
    srv.client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("script", list(SCRIPT))
def test_auto_parses_what_the_model_writes(scripted, script, stream):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": script}],
        tools=tools_of("several"),
        max_tokens=300,
    )
    content, calls, reason = answer(scripted, kw, stream)
    want_content, want_calls, want_reason = PARSED[script]
    assert content == want_content and reason == want_reason
    assert [(n, json.loads(a)) for _, n, a in calls] == want_calls
    none = answer(scripted, {**kw, "tool_choice": "none"}, stream)
    assert none == (SCRIPT[script], [], "stop")  # none: the text as written


# ---- a checkpoint's jinja template with tools ---------------------------------------------------
GLM_LIKE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>
{%- endif -%}
{% for m in messages %}
{% if m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>
{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.name }}
{%- for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>
{{- v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>{% endfor -%}
</tool_call>{% endfor %}
{%- else %}<|{{ m.role }}|>{{ m.content }}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_a_jinja_template_gets_tools_and_calls_as_glms_do():
    from dist_glm5.launch.api.chat_template import ChatTemplate

    args = json.dumps({"city": "東京", "opts": {"n": [1, 2]}}, ensure_ascii=False)
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "wx", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    out = ChatTemplate(GLM_LIKE).render(msgs, tools=tools_of("one"))
    assert '{"type": "function", "function": {"name": "wx"' in out  # tojson(ensure_ascii=False)
    assert (
        "<tool_call>wx<arg_key>city</arg_key><arg_value>東京</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"n": [1, 2]}</arg_value></tool_call>'
    ) in out
    assert "<|observation|><tool_response>ok</tool_response>" in out
    assert out.endswith("<|assistant|>")
