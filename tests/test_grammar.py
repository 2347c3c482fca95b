"""Structured output at the grammar layer, with the weakest model there is (random logits under
the mask): every completed output validates against its JSON schema (checked by `jsonschema`,
which nobody here wrote), every forced tool call parses and its arguments validate, EOS comes
only where the grammar may end, and rollback restores the mask (what MTP relies on)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from dist_glm5.checkpoint.tokenizer import ByteTokenizer
from dist_glm5.launch.api.tool_calls import parse_tool_calls
from dist_glm5.sampling.grammar import GrammarMatcher, GrammarSpec, validate

TOK = ByteTokenizer()
V, EOS = 259, (257,)


def leaf(r: random.Random, depth: int) -> dict:
    kind = r.choice(["string", "enum", "integer", "number", "boolean", "null", "array", "object"])
    if kind == "string":
        return {"type": "string", "maxLength": r.randint(0, 8)}
    if kind == "enum":
        return {"type": "string", "enum": r.sample(["a", "b c", "ü", 'q"t', "x\ny"], 3)}
    if kind == "integer":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "array":
        return {
            "type": "array",
            "items": leaf(r, depth + 1) if depth < 2 else {"type": "boolean"},
            "maxItems": 3,
        }
    if kind == "object" and depth < 2:
        return obj(r, depth + 1)
    return {"type": kind if kind != "object" else "null"}


def obj(r: random.Random, depth: int = 0) -> dict:
    names = r.sample(["id", "name", "tags", "x", "y_z", "ok", "n", "deep"], r.randint(1, 4))
    props = {k: leaf(r, depth) for k in names}
    req = [k for k in names if r.random() < 0.6]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


SCHEMAS = [obj(random.Random(i)) for i in range(50)]


def walk(spec: GrammarSpec, seed: int, limit: int = 3000, tok=TOK, bias=None) -> tuple[str, bool]:
    """Random logits (+ bias), masked: the output and whether it ended with EOS."""
    V = tok.vocab_size
    m = GrammarMatcher(spec, tok, V, EOS)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(limit):
        allowed = m.allowed()
        assert allowed.any(), "the grammar left no token allowed"
        logits = torch.randn(V, generator=g) + (0 if bias is None else bias)
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        if t in EOS:
            return tok.decode(out), True
        assert m.accept(t)
        out.append(t)
    return tok.decode(out), False


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(i):
    spec = GrammarSpec.json_schema(SCHEMAS[i])
    validate(spec, TOK)
    text, ended = walk(spec, seed=i)
    assert ended, text[:200]
    jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.mark.parametrize("i", range(12))
def test_space_run_ids_fit_the_schema(i):
    """With ids for runs of 2..16 spaces (several bytes each, favoured here), the outputs still
    validate: a run is allowed only where all its spaces fit (maxLength, tool-call values)."""
    runs = ByteTokenizer(16)
    bias = torch.zeros(runs.vocab_size)
    bias[259:] = 3.0
    text, ended = walk(GrammarSpec.json_schema(SCHEMAS[i]), seed=i, tok=runs, bias=bias)
    assert ended, text[:200]
    jsonschema.validate(json.loads(text), SCHEMAS[i])
    text, ended = walk(GrammarSpec.tool_calls(FUNCTIONS, 1, 2), seed=i, tok=runs, bias=bias)
    content, calls = parse_tool_calls(text, {f["name"]: f["parameters"] for f in FUNCTIONS})
    assert ended and content == "" and 1 <= len(calls) <= 2, text


@pytest.mark.parametrize("i", range(6))
def test_chat_tag_ids_keep_tool_calls_valid(i):
    """With one id per chat tag (favoured here), a call's tags go in as those ids and the
    outputs still parse and validate."""
    tagged = ByteTokenizer(16, chat_tags=True)
    bias = torch.zeros(tagged.vocab_size)
    bias[tagged.first_tag_id :] = 3.0
    text, ended = walk(GrammarSpec.tool_calls(FUNCTIONS, 1, 2), seed=i, tok=tagged, bias=bias)
    content, calls = parse_tool_calls(text, {f["name"]: f["parameters"] for f in FUNCTIONS})
    assert ended and content == "" and 1 <= len(calls) <= 2, text


def test_a_space_run_is_allowed_where_its_spaces_fit():
    runs = ByteTokenizer(16)
    m = GrammarMatcher(GrammarSpec.json_schema({"type": "string", "maxLength": 5}), runs, 274, EOS)
    assert m.accept(ord('"'))
    allowed = m.allowed()
    assert [k for k in range(2, 17) if allowed[runs.run_id(k)]] == [2, 3, 4, 5]
    assert m.accept(runs.run_id(4))
    allowed = m.allowed()
    assert allowed[32] and not allowed[runs.run_id(2)] and allowed[ord('"')]


def test_a_space_unit_is_allowed_where_its_spaces_fit():
    unit = ByteTokenizer(space_unit=4)
    m = GrammarMatcher(GrammarSpec.json_schema({"type": "string", "maxLength": 5}), unit, 260, EOS)
    assert m.accept(ord('"')) and m.allowed()[unit.run_id(4)]
    assert m.accept(32) and m.accept(32)
    allowed = m.allowed()  # 3 characters left: no room for 4 spaces
    assert allowed[32] and not allowed[unit.run_id(4)] and allowed[ord('"')]


def test_json_object_is_an_object():
    for seed in range(5):
        text, ended = walk(GrammarSpec("json_object"), seed, limit=6000)
        if ended:
            assert isinstance(json.loads(text), dict)


FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}},
                    "required": ["lat"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "days"],
        },
    },
    {"name": "ping", "parameters": {"type": "object", "properties": {}}},
]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("bounds", [(1, 1), (1, 3)])
def test_forced_tool_calls_parse_and_validate(seed, bounds):
    text, ended = walk(GrammarSpec.tool_calls(FUNCTIONS, *bounds), seed)
    assert ended
    tools = {f["name"]: f["parameters"] for f in FUNCTIONS}
    content, calls = parse_tool_calls(text, tools)
    assert content == "" and bounds[0] <= len(calls) <= bounds[1], text
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), tools[c["function"]["name"]])


def _takes(spec: GrammarSpec, text: bytes, tok=TOK) -> bool:
    """Does the grammar take text (in tok's ids) whole, and end there?"""
    m = GrammarMatcher(spec, tok, tok.vocab_size, (tok.eos_id,))
    return all(m.accept(t) for t in tok.encode_bytes(text)) and m.accept(tok.eos_id)


def test_properties_and_arguments_come_in_the_order_the_schema_lists_them():
    """llguidance writes an object's properties in the schema's order, so the spec keeps that
    order (it had sorted the keys: {"name", "city"} was served city first, and send_message(to,
    text) text first, where the user, OpenAI and GLM's own calls put them as declared); a call's
    optional arguments may be left out where they stand (they had been moved after the required
    ones, an order the trainer's corpus never writes)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"],
    }
    spec = GrammarSpec.json_schema(schema)
    assert _takes(spec, b'{"name":"a","city":"b"}')
    assert not _takes(spec, b'{"city":"b","name":"a"}')
    props = {"cc": {"type": "string"}, "to": {"type": "string"}, "text": {"type": "string"}}
    fn = {"name": "send", "parameters": {"type": "object", "properties": props}}
    fn["parameters"]["required"] = ["to", "text"]
    call = GrammarSpec.tool_calls([fn])
    kv = "<arg_key>{}</arg_key><arg_value>{}</arg_value>".format

    def takes(*keys: str) -> bool:
        return _takes(
            call, ("<tool_call>send" + "".join(kv(k, "x") for k in keys) + "</tool_call>").encode()
        )

    assert takes("to", "text") and takes("cc", "to", "text")
    assert not takes("text", "to") and not takes("to", "text", "cc") and not takes("to")


def test_a_raw_value_holds_no_tag_of_the_call():
    """A free string argument may hold '<' and markup, but none of the call's tags (m5g wrote
    `tunction</arg_key><arg_value>tunction ...` as one value: one argument to our reader, three
    to a reader that splits on the tags), as bytes or as the tokenizer's tag ids."""
    props = {"text": {"type": "string"}}
    fn = {"name": "f", "parameters": {"type": "object", "properties": props, "required": ["text"]}}
    call = GrammarSpec.tool_calls([fn])

    def takes(value: str, tok) -> bool:
        text = f"<tool_call>f<arg_key>text</arg_key><arg_value>{value}</arg_value></tool_call>"
        return _takes(call, text.encode(), tok)

    for tok in (TOK, ByteTokenizer(16, chat_tags=True)):
        assert takes("a <b>bold</b> x < y", tok)
        for tag in ("<arg_key>", "</arg_key>", "<arg_value>", "<tool_call>", "</tool_call>"):
            assert not takes(f"a{tag}b", tok), tag


def test_eos_only_where_the_grammar_may_end_and_rollback_restores():
    m = GrammarMatcher(GrammarSpec.json_schema({"type": "integer"}), TOK, V, EOS)
    assert not m.allowed()[EOS[0]]  # nothing yet: EOS is not allowed
    m.accept(ord("4"))
    after_4 = m.allowed()
    assert after_4[EOS[0]] and after_4[ord("2")] and not after_4[ord("x")]
    m.accept(ord("2"))
    m.rollback(1)
    assert torch.equal(m.allowed(), after_4)
    assert not m.accept(ord("x"))  # refused


def test_a_grammar_that_does_not_compile_is_named():
    with pytest.raises(ValueError, match="lark grammar does not compile"):
        validate(GrammarSpec("lark", "start: (("), TOK)
    with pytest.raises(ValueError, match="grammar kind"):
        GrammarSpec("xml")
