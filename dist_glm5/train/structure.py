"""Where a byte sits in a chat's structure: the innermost open GLM tag, and the JSON context
(depth, innermost bracket, inside a string). Targets of the trainer's structure read-outs.

Why: calls that stayed open closed a value with the wrong tag (`<arg_value>4</arg_key>`) and
JSON objects ran on: after `</arg_` the model must know which tag is open 10-30 bytes back, and
at a `,` or `}` how deep it is. A training-only read-out from a middle layer's output names both
(as the column read-outs name the run of spaces), so the layers below must carry them.
"""

from __future__ import annotations

# tags in the byte chat format (dist_glm5.checkpoint.byte_chat): class = 1 + index, 0 = none open
TAGS = ("tool_call", "arg_key", "arg_value", "tool_response", "tools")
N_TAG = len(TAGS) + 1
JSON_DEPTH = 4  # depths past this share a class
# 0: outside JSON; else 1 + in_string * 2 * JSON_DEPTH + (innermost is "[") * JSON_DEPTH + depth - 1
N_JSON = 1 + 2 * 2 * JSON_DEPTH
_OPEN = {f"<{t}>".encode(): i for i, t in enumerate(TAGS)}
_CLOSE = {f"</{t}>".encode(): i for i, t in enumerate(TAGS)}
_LONGEST = max(len(k) for k in _CLOSE)


def json_class(depth: int, square: bool, in_string: bool) -> int:
    """The JSON read-out's class of a byte inside a context (depth >= 1)."""
    return (
        1 + int(in_string) * 2 * JSON_DEPTH + int(square) * JSON_DEPTH + min(depth, JSON_DEPTH) - 1
    )


def structure_targets(ids: list[int]) -> tuple[list[int], list[int]]:
    """ids (bytes, and ids >= 256 for <eos> and the like) -> (tag, json), one class per id: the
    state after reading it (tag_targets, json_targets)."""
    return tag_targets(ids), json_targets(ids)


def _tag_event(ids: list[int], t: int) -> tuple[bool, int] | None:
    """(is a close, tag index) when id t completes "<name>" or "</name>" of TAGS, else None."""
    if ids[t] != ord(">"):
        return None
    tail = bytes(b for b in ids[max(0, t - _LONGEST + 1) : t + 1] if b < 256)
    for table, close in ((_CLOSE, True), (_OPEN, False)):
        for text, i in table.items():
            if tail.endswith(text):
                return close, i
    return None


def tag_targets(ids: list[int]) -> list[int]:
    """The innermost open tag of TAGS after each id (1 + index; 0: none). A close pops down to
    its open tag; a close with none open is ignored."""
    out, stack = [], []
    for t in range(len(ids)):
        ev = _tag_event(ids, t)
        if ev is not None and not ev[0]:
            stack.append(ev[1])
        elif ev is not None and ev[1] in stack:
            del stack[len(stack) - 1 - stack[::-1].index(ev[1]) :]
        out.append(1 + stack[-1] if stack else 0)
    return out


def json_targets(ids: list[int]) -> list[int]:
    """The JSON context after each id (json_class; 0 outside). A context opens at "{" or "["
    right after a newline or a ">" (a reply, a document, a value after <arg_value>, a tool's
    result), follows strings (with escapes) and brackets, and ends where its first bracket
    closes; a newline in a string, a "<" outside one or an id >= 256 drops it (not JSON)."""
    out = []
    brackets: list[int] = []  # open brackets ({ or [); empty: outside a context
    in_str = escaped = False
    prev = 10
    for c in ids:
        if not brackets:
            if c in (ord("{"), ord("[")) and prev in (10, ord(">")):
                brackets = [c]
        elif c >= 256 or (in_str and c == 10) or (not in_str and c == ord("<")):
            brackets, in_str, escaped = [], False, False
        elif in_str:
            in_str = escaped or c != ord('"')
            escaped = not escaped and c == ord("\\")
        elif c == ord('"'):
            in_str = True
        elif c in (ord("{"), ord("[")):
            brackets.append(c)
        elif c in (ord("}"), ord("]")):
            brackets.pop()  # a mismatched close still closes: depth is what is read
        out.append(json_class(len(brackets), brackets[-1] == ord("["), in_str) if brackets else 0)
        prev = c
    return out
