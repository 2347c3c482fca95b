"""A chat as the model was trained to read it: the checkpoint's chat template (jinja2, sandboxed
and with the whitespace settings transformers renders it with), or, for a checkpoint without one
(the embedded model's byte tokenizer), role tags and an open assistant turn."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path


class ChatTemplate:
    def __init__(self, source: str | None):
        self.source = source

    @classmethod
    def from_model_dir(cls, d: str | Path) -> ChatTemplate:
        tc = Path(d) / "tokenizer_config.json"
        return cls(json.loads(tc.read_text()).get("chat_template") if tc.exists() else None)

    @cached_property
    def _compiled(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.source)

    def render(self, messages: list[dict], **kwargs) -> str:
        """`messages`: OpenAI's dicts with text content; kwargs (tools, ...) go to the template."""
        if self.source is None:
            return simple_chat(messages)
        return self._compiled.render(messages=messages, add_generation_prompt=True, **kwargs)


def simple_chat(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def _raise(message: str):
    raise ValueError(message)
