"""The chat format of a checkpoint without a chat template (the embedded model's byte tokenizer):
role tags and an open assistant turn, tools listed in a system turn and tool calls written as GLM's
templates write them. The server renders such chats with it (launch/api/chat_template.py) and the
default model's trainer renders its chat transcripts with it (dist_glm5/train/chat_corpus.py), so
the model reads at serving time exactly what it was trained on.
"""

from __future__ import annotations

import json

# Non-string argument values as the tool-call grammar lets the model write them: compact JSON
COMPACT = (",", ":")


def simple_chat(
    messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> str:
    """Role tags; tools in a system turn as GLM lists them, earlier tool calls in GLM's format,
    tool results as observations."""
    out = []
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out.append(
            f"<|system|>\n# Tools\n<tools>\n{listed}\n</tools>\nCall as "
            "<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>\n"
        )
    for m in messages:
        if m["role"] == "tool":
            out.append(f"<|observation|>\n<tool_response>\n{m['content']}\n</tool_response>\n")
            continue
        calls = "".join(glm_call(c) for c in m.get("tool_calls") or ())
        out.append(f"<|{m['role']}|>\n{m['content'] or ''}{calls}\n")
    return "".join(out) + ("<|assistant|>\n" if add_generation_prompt else "")


def glm_call(c: dict) -> str:
    """One call ({"name", "arguments"}: arguments an object, or text kept as it is) as GLM writes
    it: string values raw, the others as compact JSON."""
    args = c["arguments"]
    if not isinstance(args, dict):
        return f"<tool_call>{c['name']}{args}</tool_call>"
    pairs = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{arg_text(v)}</arg_value>" for k, v in args.items()
    )
    return f"<tool_call>{c['name']}{pairs}</tool_call>"


def arg_text(v) -> str:
    """An argument value as the call holds it."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=COMPACT)
