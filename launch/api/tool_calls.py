"""GLM's tool-call format, read back into OpenAI `tool_calls` (whole text and streamed deltas).

The model writes, after any plain text (as vLLM's glm45/glm47 parsers read it):

    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>

with optional whitespace between the parts (GLM-4.5 puts a newline after NAME and each pair).
Argument values are raw text: a value is kept as a string when the function's schema says the
property is a string, otherwise it is JSON-decoded where it parses (numbers, booleans, objects,
arrays) and kept as a string where it does not. Anything that does not read as a complete, known
call (an unknown function, a missing tag, a repeated key, text that never closes) comes back as
plain text, never an error: the client sees what the model wrote. Text around the calls is
content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"\s*([^<\s][^<]*?)\s*(?=<arg_key>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function"}
        d["function"] = {"name": self.name, "arguments": self.arguments}
        return d if index is None else {"index": index, **d}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _value(raw: str, schema: dict | None):
    types = (schema or {}).get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types and len(types) == 1:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_call(body: str, tools: dict[str, dict]) -> ToolCall | None:
    """The text between <tool_call> and </tool_call> -> a call, or None if it is not one.

    tools: function name -> its JSON-schema `parameters`."""
    m = _NAME.match(body)
    if m is None or m.group(1) not in tools:
        return None
    name, props = m.group(1), (tools[m.group(1)] or {}).get("properties", {})
    args: dict = {}
    pos = m.end()
    while pos < len(body):
        p = _PAIR.match(body, pos)
        if p is None:
            if body[pos:].strip():
                return None  # stray text inside the call
            break
        key = p.group(1).strip()
        if key in args:
            return None
        args[key] = _value(p.group(2), props.get(key))
        pos = p.end()
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, tools: dict[str, dict]) -> tuple[str, list[dict]]:
    """A whole completion -> (content, OpenAI tool_calls): exactly what the stream of the same
    text sends, in one piece (one reader for both, so they cannot disagree)."""
    if not tools:
        return text, []
    s = ToolCallStream(tools)
    content, calls = s.feed(text)
    return content + s.finish(), calls


class ToolCallStream:
    """Streamed text deltas -> content deltas and complete tool calls, as they become certain.

    Content is held back only while it could be the start of `<tool_call>`; each call is sent
    once, when its `</tool_call>` arrives, as one OpenAI delta (id, name and the whole arguments
    string), which the openai client reassembles like any other. A call that turns out malformed,
    or is still open at the end, is flushed as content. Whitespace after a call (GLM-4.5's newline
    between calls) is not content: it is held until text that is not whitespace follows.
    """

    def __init__(self, tools: dict[str, dict]):
        self.tools, self.buf, self.index, self.in_calls = tools, "", 0, False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """-> (content to send now, tool-call deltas to send now)."""
        self.buf += delta
        content, calls = "", []
        while True:
            if not self.in_calls:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    out = self.buf[: len(self.buf) - _partial_suffix(self.buf, CALL_OPEN)]
                    if not (self.index and not out.strip()):
                        content += out
                        self.buf = self.buf[len(out) :]
                    return content, calls
                if not (self.index and not self.buf[:i].strip()):
                    content += self.buf[:i]
                self.buf, self.in_calls = self.buf[i:], True
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                return content, calls
            call = parse_call(self.buf[len(CALL_OPEN) : j], self.tools)
            if call is None:  # not a call after all: the text goes out as it was
                content += self.buf[: j + len(CALL_CLOSE)]
            else:
                calls.append(call.to_openai(self.index))
                self.index += 1
            self.buf = self.buf[j + len(CALL_CLOSE) :]
            self.in_calls = False

    def finish(self) -> str:
        """Whatever is still held back, as content (an unterminated call is text)."""
        rest, self.buf = self.buf, ""
        return "" if self.index and not rest.strip() else rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
