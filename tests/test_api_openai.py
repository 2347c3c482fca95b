"""The OpenAI fields beyond plain generation, through the official openai client against a real
server over the random model (one per module): n, logprobs + top_logprobs (chat) and logprobs
(completions) in OpenAI's shapes and equal to the model's own log-softmax, echo, batch prompts,
stream_options.include_usage, response_format json_schema, penalties, include_stop_str_in_output,
skip_special_tokens, prompt_logprobs in vLLM's shape, /v1/tokenize, /v1/detokenize, /version and
X-Request-Id. Streams are checked to reassemble to the non-streamed answer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch
from conftest import require
from runtime_util import coordinator

from dist_glm5.engine.config import CacheConfig

openai = require("openai")
MODEL = "glm5-tiny"


@pytest.fixture(scope="module")
def server(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.launch.api.app import build_app
    from dist_glm5.launch.api.engine_client import EngineClient
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.launch.api.server import HttpServer, ServerSettings
    from dist_glm5.model.config import ModelConfig

    c = coordinator(default_model_dir, cache=CacheConfig(256), max_model_len=2048)
    loop = EngineLoop(c)
    client = EngineClient(loop)
    vocab = ModelConfig.from_hf(default_model_dir).vocab_size
    model = ModelInfo.from_model_dir(default_model_dir, MODEL, 2048, vocab, c.tokenizer)
    srv = HttpServer(build_app(client, model), ServerSettings(port=0)).start()
    yield srv
    srv.stop()
    client.close()
    loop.close()


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


MSGS = [{"role": "user", "content": "Say something."}]


def chat_stream(oc, **kw):
    """Per choice index: (content, logprob entries, finish_reason); and the usage chunk."""
    out, usage = {}, None
    for ch in oc.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **kw):
        if ch.usage is not None:
            assert ch.choices == [] and usage is None
            usage = ch.usage
        for c in ch.choices:
            content, lps, reason = out.get(c.index, ("", [], None))
            lps = lps + (c.logprobs.content if c.logprobs and c.logprobs.content else [])
            out[c.index] = (content + (c.delta.content or ""), lps, c.finish_reason or reason)
    return out, usage


def test_n_chat_independent_seeds_stream_equals_json(oc):
    kw = dict(n=3, temperature=1.0, seed=7, max_tokens=6)
    r = oc.chat.completions.create(model=MODEL, messages=MSGS, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3  # seeds 7, 8, 9
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens > 0
    again = oc.chat.completions.create(model=MODEL, messages=MSGS, **kw)
    assert [c.message.content for c in again.choices] == texts
    streamed, usage = chat_stream(oc, **kw, stream_options={"include_usage": True})
    assert [streamed[i][0] for i in range(3)] == texts
    assert all(streamed[i][2] == "length" for i in range(3))
    assert usage.completion_tokens == 18 and usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_logprobs_are_the_models_and_stream_equals_json(server, oc, default_model):
    from dist_glm5.model.reference_loop import full_logits

    kw = dict(logprobs=True, top_logprobs=3, max_tokens=5, temperature=0)
    r = oc.chat.completions.create(model=MODEL, messages=MSGS, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(x.top_logprobs) == 3 for x in content)
    ids = httpx.post(server.url + "/v1/tokenize", json={"messages": MSGS}).json()["tokens"]
    out = [x.bytes[0] for x in content]  # byte tokens: the id is the byte
    ref = torch.log_softmax(full_logits(default_model, ids + out), -1)[len(ids) - 1 :]
    for i, x in enumerate(content):
        assert abs(x.logprob - ref[i, out[i]].item()) < 1e-4
        assert [t.bytes[0] for t in x.top_logprobs] == ref[i].topk(3).indices.tolist()
        assert x.top_logprobs[0].logprob >= x.logprob  # greedy: the top one was chosen
    streamed, _ = chat_stream(oc, **kw)
    assert streamed[0][0] == r.choices[0].message.content
    assert [(x.token, x.logprob, x.bytes) for x in streamed[0][1]] == [
        (x.token, x.logprob, x.bytes) for x in content
    ]


def test_completions_batch_n_echo_logprobs_stream_equals_json(oc):
    kw = dict(
        model=MODEL,
        prompt=["ab", "xyz"],
        n=2,
        echo=True,
        logprobs=2,
        max_tokens=3,
        temperature=0.8,
        seed=3,
    )
    r = oc.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    for c in r.choices:
        prompt = kw["prompt"][c.index // 2]
        assert c.text.startswith(prompt)
        lp = c.logprobs
        n = len(prompt) + 3
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens[: len(prompt)]) == prompt
        assert lp.text_offset == list(range(n))  # one byte, one character per token here
        assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # choice j of a prompt is the j-th seed: the same as that prompt asked alone
    alone = oc.completions.create(**{**kw, "prompt": "xyz", "n": 1, "seed": 4})
    assert alone.choices[0].text == r.choices[3].text
    # the stream, reassembled per choice
    parts = {}
    chunks = list(oc.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for ch in chunks:
        for c in ch.choices:
            text, lps, reason = parts.get(c.index, ("", [], None))
            lps = lps + (c.logprobs.token_logprobs if c.logprobs else [])
            parts[c.index] = (text + c.text, lps, c.finish_reason or reason)
    # Texts and finish reasons equal; logprobs to float noise: the two requests may be batched
    # differently (with each other's prefill, or another test's), and a GEMM's rounding follows
    # its row count (a 1-ulp difference seen when this test ran alone). Batch invariance is not
    # promised.
    for c in r.choices:
        text, lps, reason = parts[c.index]
        assert (text, reason) == (c.text, c.finish_reason)
        want = c.logprobs.token_logprobs
        assert len(lps) == len(want) and [x is None for x in lps] == [x is None for x in want]
        assert [x for x in lps if x is not None] == pytest.approx(
            [x for x in want if x is not None], abs=1e-5
        )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_prompt_logprobs_in_vllms_shape(oc, default_model):
    from dist_glm5.model.reference_loop import full_logits

    r = oc.completions.create(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ref = torch.log_softmax(full_logits(default_model, [5, 6, 7, 8]), -1)
    assert plp[0] is None and len(plp) == 4
    for i, entry in enumerate(plp[1:]):
        tok = [5, 6, 7, 8][i + 1]
        assert abs(entry[str(tok)]["logprob"] - ref[i, tok].item()) < 1e-4
        rank = int((ref[i] > ref[i, tok]).sum()) + 1
        assert entry[str(tok)]["rank"] == rank
        top = ref[i].topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2] and set(entry) <= {
            str(tok),
            *map(str, top),
        }


SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "tags": {"type": "array", "items": {"enum": ["a", 'b"c']}, "maxItems": 2},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_response_format_json_schema(oc, i):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True},
    }
    kw = dict(response_format=fmt, max_tokens=80)
    for temperature in (0, 1.0):
        r = oc.chat.completions.create(
            model=MODEL, messages=MSGS, **kw, temperature=temperature, seed=i
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])
        s, _ = chat_stream(oc, **kw, temperature=temperature, seed=i)
        assert s[0][0] == r.choices[0].message.content and s[0][2] == "stop"


def test_penalties_stop_strings_and_special_tokens(oc):
    base = dict(model=MODEL, prompt="abcabc", max_tokens=12, temperature=0)
    plain = oc.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    pen = oc.completions.create(
        **base,
        frequency_penalty=2,
        presence_penalty=1,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    )
    assert pen.choices[0].text != plain
    stop = plain[3:5]
    cut = oc.completions.create(**base, stop=[stop]).choices[0].text
    kept = oc.completions.create(
        **base, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert cut == plain[:3] and kept.choices[0].text == plain[:5]
    bos = dict(base, max_tokens=2, logit_bias={"256": 100})
    shown = oc.completions.create(**bos, extra_body={"skip_special_tokens": False})
    assert oc.completions.create(**bos).choices[0].text == ""
    assert shown.choices[0].text == "<bos><bos>"


def test_tokenize_detokenize_version_and_request_id(server):
    u = server.url
    r = httpx.post(u + "/v1/tokenize", json={"prompt": "hé", "return_token_strs": True})
    assert r.json()["tokens"] == list("hé".encode()) and r.json()["count"] == 3
    assert r.json()["max_model_len"] == 2048 and len(r.json()["token_strs"]) == 3
    assert httpx.post(u + "/tokenize", json={"prompt": "hé"}).json()["tokens"] == [104, 195, 169]
    d = httpx.post(u + "/v1/detokenize", json={"tokens": [104, 195, 169]})
    assert d.json() == {"prompt": "hé"}
    assert httpx.post(u + "/v1/detokenize", json={"tokens": [9999]}).status_code == 400
    assert httpx.post(u + "/v1/tokenize", json={"prompt": "a", "messages": MSGS}).status_code == 400
    assert httpx.get(u + "/version").json()["version"]
    # X-Request-Id: echoed (JSON, SSE, errors), or a fresh one
    h = {"X-Request-Id": "trace-42"}
    body = {"prompt": "a", "max_tokens": 1}
    assert httpx.post(u + "/v1/completions", json=body, headers=h).headers["x-request-id"] == (
        "trace-42"
    )
    with httpx.stream("POST", u + "/v1/completions", json={**body, "stream": True}, headers=h) as s:
        assert s.headers["x-request-id"] == "trace-42" and s.read().endswith(b"[DONE]\n\n")
    bad = httpx.post(u + "/v1/completions", json={"max_tokens": 1}, headers=h)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "trace-42"
    a, b = (httpx.get(u + "/version").headers["x-request-id"] for _ in range(2))
    assert a != b and len(a) == 32


def test_bad_words_are_banned_with_and_without_a_leading_space():
    """As vLLM: a BPE spells " word" differently from "word"; both are banned."""
    from dist_glm5.launch.api.engine_request import ModelInfo, _bad_words

    class Bpe:
        def encode(self, text):
            return {"word": [1, 2], " word": [3], "ab": [4, 5], " ab": [6, 4, 5]}[text]

    assert _bad_words(["word", "ab"], ModelInfo("m", 64, 10, Bpe())) == ((1, 2), (3,), (4, 5))
