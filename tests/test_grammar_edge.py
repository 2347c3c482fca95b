"""Grammars checked at the edge (issue 24, items 6, 7 and 10).

- Item 6: regexes, JSON-schema patterns and grammars that llguidance builds but cannot serve
  (`a{1000000}`, `((a{100}){100}){100}`: the first mask spends the lexer's fuel and the worker
  failed at the next token) and unsatisfiable ones (a self-referencing $ref, a regex matching
  nothing) are 400s naming the field; what the edge accepts, the worker's matcher (same limits,
  carried in the spec) serves to the end. The check drops the GIL: a thread beside it keeps
  ticking.
- Item 7: a tool parameter `pattern` is embedded, never pasted: a `/` works, a crafted pattern
  adds no rule, values the grammar lets through match the pattern by Python's `re` and the
  arguments validate by `jsonschema` (the oracles); errors never show our internal grammar;
  `parameters` that are not JSON Schema are a 400 naming `tools.N.function.parameters`.
- Item 10: a named tool_choice (and "required" without parallel calls) is exactly one call.

Over HTTP: a server on a scripted engine for the refusals (they never reach an engine) and one
on the random model for what must be generated.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
import torch
from runtime_util import coordinator
from test_api_tools import ScriptedLoop, start_server

from dist_glm5.checkpoint.tokenizer import ByteTokenizer
from dist_glm5.engine.config import CacheConfig
from dist_glm5.launch.api.tool_calls import parse_tool_calls
from dist_glm5.sampling.grammar import (
    GrammarError,
    GrammarLimits,
    GrammarMatcher,
    GrammarSpec,
    check,
    pattern_regex,
)
from dist_glm5.sampling.params import SamplingParams

TOK = ByteTokenizer()
V, EOS = 259, (257,)
MODEL = "glm5-tiny"


def fn(name, props, required=None):
    return {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False,
        },
    }


def walk(spec, seed, limit=3000):
    """Random logits under the worker's mask -> (text, ended with EOS)."""
    m = GrammarMatcher(spec, TOK, V, EOS)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(limit):
        allowed = m.allowed()
        assert allowed.any(), "the grammar left no token allowed"
        t = int(torch.randn(V, generator=g).masked_fill(~allowed, float("-inf")).argmax())
        if t in EOS:
            return TOK.decode(out), True
        assert m.accept(t), TOK.decode(out)
        out.append(t)
    return TOK.decode(out), False


def refusal(spec) -> GrammarError:
    with pytest.raises(GrammarError) as e:
        check(spec, TOK)
    return e.value


# ---- item 6: too large, unsatisfiable, invalid ---------------------------------------------------
POISON = {
    "regex a{1000000}": GrammarSpec("regex", "a{1000000}"),
    "regex nested": GrammarSpec("regex", "((a{100}){100}){100}"),
    "regex after a branch": GrammarSpec("regex", "(b|c)a{1000000}"),
    "lark lexeme": GrammarSpec("lark", "start: /[xy]+/ q\nq: /a{1000000}/"),
    "schema pattern": GrammarSpec.json_schema({"type": "string", "pattern": "^a{1000000}$"}),
    "nested property pattern": GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"k": {"type": "string", "pattern": "^((a{100}){100}){100}$"}},
            "required": ["k"],
        }
    ),
    "tool pattern": GrammarSpec.tool_calls(
        [fn("f", {"p": {"type": "string", "pattern": "^a{1000000}$"}})]
    ),
}


@pytest.mark.parametrize("name", list(POISON))
def test_grammars_the_worker_cannot_serve_are_too_large(name):
    spec = POISON[name]
    # what the worker did with it: built, one mask, then the next token fails (or, for a tool
    # pattern, its matcher is refused when built)
    with pytest.raises((AssertionError, GrammarError)):
        walk(spec, seed=0, limit=50)
    t0 = time.perf_counter()
    e = refusal(spec)
    assert e.why == "too_large" and "grammar limits" in str(e), str(e)
    print(f"{name}: refused in {(time.perf_counter() - t0) * 1e3:.0f} ms")


UNSATISFIABLE = {
    "self $ref": GrammarSpec.json_schema({"$ref": "#"}),
    "$ref loop": GrammarSpec.json_schema(
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    ),
    "empty class": GrammarSpec("regex", r"[^\x00-\x{10FFFF}]"),
    "empty interval": GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
    "lark nothing": GrammarSpec("lark", "start: AB\nAB: /[a]/ & /[b]/"),
}


@pytest.mark.parametrize("name", list(UNSATISFIABLE))
def test_unsatisfiable_grammars_are_refused(name):
    e = refusal(UNSATISFIABLE[name])
    assert e.why == "unsatisfiable" and "cannot be satisfied" in str(e), str(e)


def test_schemas_too_deep_to_serialise_are_refused():
    deep = {"type": "integer"}
    for _ in range(600):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nested too deeply"):
        GrammarSpec.json_schema(deep)
    with pytest.raises(GrammarError, match="nested too deeply"):
        GrammarSpec.tool_calls([{"name": "f", "parameters": deep}])


def test_invalid_grammars_are_named_without_our_wrapping():
    e = refusal(GrammarSpec("regex", "(("))
    assert e.why == "invalid" and "unclosed group" in str(e)
    assert "start:" not in str(e)  # our `start: /.../` around a regex is not the client's


ACCEPTED = [
    GrammarSpec("regex", "a{1000}"),
    GrammarSpec("regex", "[a-c]{3,9}(/[0-9]+)?"),
    GrammarSpec("regex", ""),
    GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]+/[0-9]{2}$"},
                "n": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["id", "n"],
        }
    ),
    GrammarSpec("lark", 'start: "x" /[0-9]{1,4}/ | "y"'),
    GrammarSpec.tool_calls([fn("f", {"p": {"type": "string", "pattern": "^a/b+$"}})], 1, 1),
]


@pytest.mark.parametrize("i", range(len(ACCEPTED)))
def test_what_the_edge_accepts_the_worker_serves_to_the_end(i):
    spec = ACCEPTED[i]
    check(spec, TOK)
    for seed in range(4):
        text, ended = walk(spec, seed)
        assert ended, text[:100]
        if spec.kind == "regex":  # the oracle: Python's re on the whole output
            assert re.fullmatch(spec.text, text), (spec.text, text)


def test_limits_are_configured_carried_and_used_by_the_worker():
    env = {"DIST_GLM5_GRAMMAR_MAX_GRAMMAR_SIZE": "30", "DIST_GLM5_GRAMMAR_CHECK_TOKENS": "4"}
    small = GrammarLimits.from_env(env)
    assert small.max_grammar_size == 30 and small.check_tokens == 4
    assert small.initial_lexer_fuel == GrammarLimits().initial_lexer_fuel
    with pytest.raises(ValueError, match="DIST_GLM5_GRAMMAR_STEP_MAX_ITEMS"):
        GrammarLimits.from_env({"DIST_GLM5_GRAMMAR_STEP_MAX_ITEMS": "-1"})
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20)}}
    spec = GrammarSpec.json_schema(schema)
    check(spec, TOK)  # fits the default limits
    tight = GrammarSpec("json_schema", spec.text, limits=small)
    assert refusal(tight).why == "too_large"
    with pytest.raises(GrammarError, match="too large"):  # the worker compiles with the same
        GrammarMatcher(tight, TOK, V, EOS)
    # the limits travel with the request to the last stage (the control plane's msgpack)
    from dist_glm5.engine.messages import pack, unpack

    back = unpack(pack(SamplingParams(max_tokens=4, grammar=tight)))
    assert back.grammar == tight and back.grammar.limits == small


def test_the_check_drops_the_gil():
    """A thread ticking every ms beside the slowest refusal keeps its ticks < 100 ms apart."""
    spec = POISON["regex nested"]
    gaps, done = [], threading.Event()

    def run():
        try:
            check(spec, TOK)
        except GrammarError:
            pass
        done.set()

    check(GrammarSpec("regex", "a"), TOK)  # the tokenizer is built (once per process)
    t = threading.Thread(target=run)
    t0 = last = time.perf_counter()
    t.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    t.join()
    total = time.perf_counter() - t0
    print(f"check took {total * 1e3:.0f} ms; longest tick gap {max(gaps) * 1e3:.1f} ms")
    # held throughout, the longest gap would be the whole check; a loaded machine stretches
    # ticks, so the bound is relative to the check's own time (never under 100 ms)
    assert total > 0.05 and max(gaps) < max(0.1, total / 3), (total, max(gaps))


# ---- item 7: patterns embedded, never injected ---------------------------------------------------
# bounded, anchored patterns: a walk under random logits ends, so its output can be checked
PATTERNS = [
    "^a/b$",  # a slash
    r"^\d{2}/\d{2}$",  # \d is ASCII, as in JSON schema
    r"^[|)(/]{1,5}$",  # a class holding what would split or close a group
    r"^a\${1,3}$",  # an escaped dollar, then the end
    "^(x|y/)$|^z{2}$",  # alternatives, each anchored
    '^a/ "<a>" \nfoo: /b$',  # shaped to end a Lark regex and start a rule: literal text
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_what_a_tool_pattern_lets_through_matches_it(pattern):
    f = fn("f", {"p": {"type": "string", "pattern": pattern}, "n": {"type": "integer"}})
    spec = GrammarSpec.tool_calls([f], 1, 1)
    check(spec, TOK)
    for seed in range(6):
        text, ended = walk(spec, seed)
        assert ended, text[:200]
        content, calls = parse_tool_calls(text, {"f": f["parameters"]})
        assert content == "" and len(calls) == 1, text
        args = json.loads(calls[0]["function"]["arguments"])
        assert re.search(pattern, args["p"]), (pattern, args["p"])  # Python's re: the oracle
        jsonschema.validate(args, f["parameters"])


# search semantics: a value is let through exactly when Python's re finds the pattern in it
SEARCHED = {
    "/": ["/", "a/b", "ab", "", "//x"],
    "^x|y$": ["x", "xa", "ay", "y", "ax", "ya", ""],
    "b+c": ["abbcd", "bc", "ac", "b", "cb"],
    r"^\d+$": ["12", "1a", "", "0"],
    'a/ "</x>" \nfoo: /b': ['a/ "</x>" \nfoo: /b', 'za/ "</x>" \nfoo: /bz', "foo: /b", "a/"],
    r"^[^/]{2}$": ["ab", "a/", "abc", "é€"],
}


def lets_through(spec, value):
    m = GrammarMatcher(spec, TOK, V, EOS)
    call = f"<tool_call>f<arg_key>p</arg_key><arg_value>{value}</arg_value></tool_call>"
    return m.m.consume_tokens(list(call.encode())) and m.m.is_accepting()


@pytest.mark.parametrize("pattern", list(SEARCHED))
def test_tool_patterns_are_searched_for_as_python_re_does(pattern):
    spec = GrammarSpec.tool_calls([fn("f", {"p": {"type": "string", "pattern": pattern}})], 1, 1)
    check(spec, TOK)
    for value in SEARCHED[pattern]:
        assert lets_through(spec, value) == bool(re.search(pattern, value)), (pattern, value)


def test_pattern_and_length_both_hold():
    schema = {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 3}
    spec = GrammarSpec.tool_calls([fn("f", {"p": schema})], 1, 1)
    for value in ["a", "ab", "abc", "abcd", "aB"]:
        want = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert lets_through(spec, value) == want, value


def test_a_crafted_pattern_adds_no_rule():
    pattern = '/ "<a>" ">"\nstart: "pwned'
    spec = GrammarSpec.tool_calls([fn("f", {"p": {"type": "string", "pattern": pattern}})], 1, 1)
    check(spec, TOK)
    m = GrammarMatcher(spec, TOK, V, EOS)
    assert not m.m.consume_tokens(list(b"pwned"))  # no `start` of the client's
    assert not lets_through(spec, '"pwned')  # the value must contain the pattern
    assert lets_through(spec, pattern + "!")


@pytest.mark.parametrize("pattern", ["x)|(y", "(a", "[ab", "a\\"])
def test_patterns_reaching_outside_their_group_are_refused(pattern):
    with pytest.raises(ValueError):
        pattern_regex(pattern)
    spec = GrammarSpec.tool_calls([fn("f", {"p": {"type": "string", "pattern": pattern}})], 1, 1)
    assert refusal(spec).why == "invalid"


def test_errors_never_show_the_internal_grammar():
    bad = GrammarSpec.tool_calls(
        [
            fn(
                "f",
                {
                    "p": {"type": "string", "pattern": "^a(?=b)"},
                    "q": {"type": "integer", "minimum": 3, "maximum": 1},
                },
            )
        ]
    )
    e = refusal(bad)
    for internal in ("arg_value", "start:", "<tool_call>", "fn_0", "val_0", "(?s:.)", "<state>"):
        assert internal not in str(e), str(e)


# ---- item 10: a named function is called exactly once -----------------------------------------
def test_one_call_then_only_eos():
    fs = [fn("a", {"x": {"type": "integer", "minimum": 0, "maximum": 9}}), fn("b", {})]
    for seed in range(8):
        m = GrammarMatcher(GrammarSpec.tool_calls(fs[:1], 1, 1), TOK, V, EOS)
        g = torch.Generator().manual_seed(seed)
        out = []
        while not m.done:
            allowed = m.allowed()
            t = int(torch.randn(V, generator=g).masked_fill(~allowed, float("-inf")).argmax())
            if t in EOS:
                break
            assert m.accept(t)
            out.append(t)
        allowed = m.allowed()  # after one call: EOS and nothing else
        assert allowed[EOS[0]] and int(allowed.sum()) == 1, TOK.decode(out)
        assert TOK.decode(out).count("<tool_call>") == 1


# ---- over HTTP -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted():
    srv = start_server(ScriptedLoop(TOK), _model_info(TOK, 4096, V))
    yield srv
    srv.stop()
    srv.client.close()


def _model_info(tok, max_len, vocab, d=None):
    from dist_glm5.launch.api.engine_request import ModelInfo

    if d is None:
        return ModelInfo(MODEL, max_len, vocab, tok)
    return ModelInfo.from_model_dir(d, MODEL, max_len, vocab, tok)


def tools(*fs):
    return [{"type": "function", "function": f} for f in fs]


NESTED = "^((a{100}){100}){100}$"
REFUSALS = {
    "guided_regex huge": ({"guided_regex": "a{1000000}"}, "guided_regex", "too large"),
    "guided_regex nested": ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", "too large"),
    "guided_regex nothing": (
        {"guided_regex": r"[^\x00-\x{10FFFF}]"},
        "guided_regex",
        "cannot be satisfied",
    ),
    "pattern in response_format": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": NESTED}},
            }
        },
        "response_format",
        "too large",
    ),
    "guided_json $ref": ({"guided_json": {"$ref": "#"}}, "guided_json", "cannot be satisfied"),
    "parameters not a schema": (
        {"tools": tools(fn("ok", {}), {"name": "bad", "parameters": {"type": "foo"}})},
        "tools.1.function.parameters",
        "not a valid JSON Schema",
    ),
    "$schema not a string": (
        {"tools": tools({"name": "f", "parameters": {"$schema": {}}})},
        "tools.0.function.parameters",
        "$schema must be a string",
    ),
    "pattern not a regex": (
        {"tools": tools(fn("f", {"p": {"type": "string", "pattern": "x)|(y"}}))},
        "tools.0.function.parameters",
        "not a valid JSON Schema",
    ),
    "tool pattern too large": (
        {
            "tools": tools(fn("ok", {}), fn("f", {"p": {"type": "string", "pattern": NESTED}})),
            "tool_choice": "required",
        },
        "tools.1.function.parameters",
        "too large",
    ),
    "named tool unsatisfiable": (
        {
            "tools": tools(fn("f", {"n": {"type": "integer", "minimum": 3, "maximum": 1}})),
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools.0.function.parameters",
        "cannot be satisfied",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_are_400s_naming_the_field(scripted, name):
    body, param, says = REFUSALS[name]
    t0 = time.perf_counter()
    r = httpx.post(
        scripted.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "call"}], "max_tokens": 8, **body},
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], r.text
    for internal in ("arg_value", "start:", "fn_0", "(?s:.)", "<state>"):
        assert internal not in err["message"]
    print(f"{name}: 400 in {(time.perf_counter() - t0) * 1e3:.0f} ms: {err['message'][:120]}")


def test_the_server_answers_while_it_checks_a_poison_grammar(scripted):
    """/health stays fast while the slowest grammar is compiled for another request."""
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "guided_regex": "((a{100}){100}){100}",
    }
    with httpx.Client(base_url=scripted.url, timeout=60) as c:
        c.get("/health")
        out = {}
        t = threading.Thread(target=lambda: out.update(r=c.post("/v1/chat/completions", json=body)))
        t0 = time.perf_counter()
        t.start()
        worst = 0.0
        while t.is_alive():
            s = time.perf_counter()
            assert c.get("/health").status_code == 200
            worst = max(worst, time.perf_counter() - s)
        t.join()
    total = time.perf_counter() - t0
    print(f"poison checked in {total * 1e3:.0f} ms; slowest /health {worst * 1e3:.0f} ms")
    # a stalled loop would hold /health for the whole check (relative: a loaded machine)
    assert out["r"].status_code == 400 and worst < max(0.25, total / 3), (out["r"].text, worst)


@pytest.fixture(scope="module")
def real(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.model.config import ModelConfig

    c = coordinator(default_model_dir, cache=CacheConfig(256), max_model_len=2048)
    loop = EngineLoop(c)
    vocab = ModelConfig.from_hf(default_model_dir).vocab_size
    srv = start_server(loop, _model_info(c.tokenizer, 2048, vocab, default_model_dir))
    yield srv
    srv.stop()
    srv.client.close()
    loop.close()


ADD = fn(
    "add",
    {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
)
PATH = fn("open", {"path": {"type": "string", "pattern": r"^/[a-z]{1,6}(/[a-z0-9]{1,4}){0,2}$"}})


@pytest.mark.parametrize(
    "choice,extra,calls",
    [
        ({"type": "function", "function": {"name": "add"}}, {}, 1),
        ("required", {"parallel_tool_calls": False}, 1),
        ("required", {}, 2),  # one or more: held for a second call, then let end
        ({"type": "function", "function": {"name": "open"}}, {}, 1),  # a pattern with `/`
    ],
)
def test_calls_over_http(real, choice, extra, calls):
    # min_tokens holds EOS back past one call (a call is < 120 bytes); where the grammar allows
    # only one call it ends there anyway, and a bias on EOS ends at the first place it may
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "temperature": 0,
        "tools": tools(ADD, PATH),
        "tool_choice": choice,
        "max_tokens": 300,
        "min_tokens": 120,
        "logit_bias": {"257": 100},
        **extra,
    }
    r = httpx.post(real.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    got = ch["message"]["tool_calls"]
    assert ch["finish_reason"] == "tool_calls" and len(got) == calls, ch
    schemas = {f["name"]: f["parameters"] for f in (ADD, PATH)}
    for c in got:
        args = json.loads(c["function"]["arguments"])
        jsonschema.validate(args, schemas[c["function"]["name"]])  # pattern by Python's re
        if isinstance(choice, dict):
            assert c["function"]["name"] == choice["function"]["name"]


def test_a_guided_regex_with_a_slash_over_http(real):
    rx = r"[a-z]{2,5}/[0-9]{1,3}"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "guided_regex": rx,
        "max_tokens": 40,
        "temperature": 1,
        "seed": 5,
    }
    r = httpx.post(real.url + "/v1/chat/completions", json=body, timeout=300)
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and re.fullmatch(rx, ch["message"]["content"]), ch
