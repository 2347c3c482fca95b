"""A chat as the model was trained to read it: the checkpoint's chat template (jinja2, sandboxed
and with the whitespace settings and `tojson` filter transformers renders it with), or, for a
checkpoint without one (the embedded model's byte tokenizer), role tags and an open assistant turn
(`simple_chat` in dist_glm5/checkpoint/byte_chat.py, which writes tools and tool calls the way
GLM's templates do; the default model's trainer renders its chats with it too).

Messages reach a template as OpenAI's dicts, with one change made as vLLM makes it: a tool call's
`arguments` (a JSON string in the API) is given as the object it encodes, since GLM's templates
iterate over `arguments.items()` to write `<arg_key>`/`<arg_value>` pairs.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from dist_glm5.checkpoint.byte_chat import simple_chat


class ChatTemplate:
    def __init__(self, source: str | None):
        self.source = source

    @classmethod
    def from_model_dir(cls, d: str | Path) -> ChatTemplate:
        tc = Path(d) / "tokenizer_config.json"
        source = json.loads(tc.read_text()).get("chat_template") if tc.exists() else None
        jinja = Path(d) / "chat_template.jinja"  # transformers' newer layout
        if source is None and jinja.exists():
            source = jinja.read_text()
        return cls(source)

    @cached_property
    def _compiled(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        return env.from_string(self.source)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs,
    ) -> str:
        """`messages`: OpenAI's dicts (text content; tool calls with `arguments` as text); `tools`:
        OpenAI's tool objects; kwargs (chat_template_kwargs) go to the template."""
        messages = [_for_template(m) for m in messages]
        if self.source is None:
            return simple_chat(messages, tools, add_generation_prompt)
        return self._compiled.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _for_template(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        f = dict(c["function"])
        try:
            f["arguments"] = json.loads(f["arguments"])
        except ValueError:
            pass  # not JSON: the template gets the text
        calls.append({**c, "function": f, **f})  # GLM's templates read tc.name / tc.arguments
    return {**m, "tool_calls": calls}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson (templates call tojson(ensure_ascii=False)); not jinja2's, which
    HTML-escapes."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str):
    raise ValueError(message)
