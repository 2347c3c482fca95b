"""The structure read-outs' targets (dist_glm5/train/structure.py) against a parser written
here: tags from a regex's open/close events, JSON spans from json's own decoder, strings from a
regex, depth from bracket counts."""

from __future__ import annotations

import json
import random
import re

import torch

from dist_glm5.train import chat_corpus, structure
from dist_glm5.train import trainer as td

WORDS = chat_corpus.Words(("path", "size", "name", "items", "count", "value", "mode"))
TAG_RE = re.compile(r"<(/?)(tool_call|arg_key|arg_value|tool_response|tools)>")
STRING_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def _tags_by_regex(text: str) -> list[int]:
    out, stack, events = [0] * len(text), [], {}
    for m in TAG_RE.finditer(text):
        events[m.end() - 1] = (m.group(1) == "/", structure.TAGS.index(m.group(2)))
    for t in range(len(text)):
        if t in events:
            close, i = events[t]
            if not close:
                stack.append(i)
            elif i in stack:
                while stack.pop() != i:
                    pass
        out[t] = 1 + stack[-1] if stack else 0
    return out


def _json_by_decoder(text: str) -> tuple[list[int], int]:
    """(classes, how far they are known: up to a JSON value the row cuts off)."""
    out, t, dec = [0] * len(text), 0, json.JSONDecoder()
    while t < len(text):
        if text[t] in "{[" and (t == 0 or text[t - 1] in "\n>"):
            try:
                _, end = dec.raw_decode(text, t)
            except json.JSONDecodeError:
                return out, t  # cut off by the row's end
            span = text[t:end]
            strings = [range(m.start(), m.end()) for m in STRING_RE.finditer(span)]
            in_str = [False] * len(span)
            for r in strings:
                for k in r[:-1]:  # the closing quote is read outside the string
                    in_str[k] = True
            depth, d, opens = [], 0, []
            for k, ch in enumerate(span):
                quoted = in_str[k] or (k > 0 and in_str[k - 1])
                if not quoted and ch in "{[":
                    d += 1
                    opens.append(k)
                elif not quoted and ch in "}]":
                    d -= 1
                depth.append(d)
            for k in range(len(span) - 1):  # the last byte closes the value: outside again
                # the innermost bracket: the last opening bracket at this depth
                q = max(o for o in opens if o <= k and depth[o] == depth[k])
                out[t + k] = structure.json_class(depth[k], span[q] == "[", in_str[k])
            t = end
        else:
            t += 1
    return out, len(text)


def _rows(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        ids, _, _ = chat_corpus.chat_row(rng, WORDS, 700, b"def f(x):\n    return x\n" * 40)
        yield ids, "".join(chr(i) if i < 256 else "\0" for i in ids)


def test_tag_targets_match_a_regex_stack():
    for ids, text in _rows(40, 0):
        tag, _ = structure.structure_targets(ids)
        assert tag == _tags_by_regex(text)


def test_json_targets_match_the_json_decoder():
    seen = set()
    for ids, text in _rows(40, 1):
        _, js = structure.structure_targets(ids)
        want, known = _json_by_decoder(text)
        assert js[:known] == want[:known]
        seen |= set(js)
    assert len(seen) > 8  # strings, arrays and nesting all met


def test_the_open_tag_is_named_where_a_value_closes():
    """After `</arg_` the read-out must say which tag is open (the runs wrote </arg_key>)."""
    text = b"<tool_call>f<arg_key>n</arg_key><arg_value>4</arg_value></tool_call>"
    tag, _ = structure.structure_targets(list(text))
    at = text.index(b"</arg_value>") + len(b"</arg_")
    assert tag[at] == 1 + structure.TAGS.index("arg_value")
    assert tag[-1] == 0 and tag[text.index(b"f")] == 1 + structure.TAGS.index("tool_call")


def test_structure_read_outs_train_the_layers_below():
    from test_train_default import TINY

    tr = td.Trainer(td.hf_config(TINY), seed=0)
    tr.rows_gen.manual_seed(0)
    ids = torch.tensor([list(b'<tool_call>f<arg_key>n</arg_key><arg_value>{"a":[1]}</arg_value>')])
    tr.losses(ids)
    sup = tr.structure_losses(ids)
    assert {"tag", "json"} <= set(td.SUPERVISION)
    (sup["tag"] + sup["json"]).backward()
    assert tr.structure["tag"].weight.grad.any() and tr.structure["json"].weight.grad.any()
    assert tr.model.model.layers[0].self_attn.o_proj.weight.grad.any()


def test_json_targets_follow_escapes_and_nesting():
    text = '<arg_value>{"a": [1, {"b": "x]\\\\\\"}"}], "c": "<"}</arg_value>\n[[{"d":"\\\\"}]]\n'
    json.loads(text[len("<arg_value>") : text.index("</")])  # the sample is JSON
    _, js = structure.structure_targets(list(text.encode()))
    assert js == _json_by_decoder(text)[0]
    assert max(js) == structure.json_class(3, False, True)  # in "x]\\\"}" at depth 3
