"""The GLM tool-call reader on crafted model text: well-formed calls, GLM-4.5's newlines, values
typed by the schema, malformed and truncated calls (text, never an error), and streaming in
every split equal to the whole."""

from __future__ import annotations

import json

import pytest

from dist_glm5.launch.api.tool_calls import ToolCallStream, parse_tool_calls

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "opts": {"type": "object"},
            "code": {"type": "string"},
        },
    },
    "ping": {"type": "object", "properties": {}},
}


def args(call):
    return json.loads(call["function"]["arguments"])


def test_one_call_values_typed_by_schema():
    text = (
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>opts</arg_key>"
        '<arg_value>{"unit": "C", "n": [1, 2]}</arg_value>'
        "<arg_key>code</arg_key><arg_value>123</arg_value></tool_call>"
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    # "123" stays a string where the schema says string; 3 is an integer
    assert args(calls[0]) == {
        "city": "Paris",
        "days": 3,
        "opts": {"unit": "C", "n": [1, 2]},
        "code": "123",
    }
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_glm45_newlines_parallel_calls_and_no_arguments():
    text = (
        '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich "Nord"\nline2'
        "</arg_value>\n</tool_call>\n<tool_call>ping</tool_call>"
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content.strip() == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert [c["index"] for c in calls] == [0, 1]
    assert args(calls[0]) == {"city": 'Zürich "Nord"\nline2'} and args(calls[1]) == {}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris",  # truncated
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",  # unclosed
        "<tool_call>unknown_fn<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>",  # no value tags
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</arg_value>"
        "<arg_key>city</arg_key><arg_value>b</arg_value></tool_call>",  # repeated key
        "<tool_call>get_weather junk<arg_key>city</arg_key><arg_value>a</arg_value></tool_call>",
        "<tool_call></tool_call>",
        "<tool_call",
    ],
)
def test_malformed_calls_come_back_as_text(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls == [] and content == text


def test_no_tools_means_no_parsing():
    text = "<tool_call>ping</tool_call>"
    assert parse_tool_calls(text, {}) == (text, [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_in_any_split_equals_the_whole(step):
    text = (
        "Sure <b>bold</b> <tool_ca not a tag. <tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Rome</arg_value></tool_call>between<tool_call>bad</tool_call>"
        "<tool_call>ping</tool_call><tool_call>get_weather<arg_key>city"
    )
    whole_content, whole_calls = parse_tool_calls(text, TOOLS)
    s, content, calls = ToolCallStream(TOOLS), "", []
    for i in range(0, len(text), step):
        c, k = s.feed(text[i : i + step])
        content += c
        calls += k
    content += s.finish()
    assert content == whole_content
    assert [(c["index"], c["function"]) for c in calls] == [
        (c["index"], c["function"]) for c in whole_calls
    ]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert content == (
        "Sure <b>bold</b> <tool_ca not a tag. between<tool_call>bad</tool_call>"
        "<tool_call>get_weather<arg_key>city"
    )
