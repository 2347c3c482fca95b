"""The default model's chat corpus (dist_glm5/train/chat_corpus.py), read back by code that did
not write it: the server's chat format renders the same prompt, the server's tool-call reader
(launch/api/tool_calls.py) parses every call, `jsonschema` validates its arguments against the
function's schema, `json` parses every JSON reply and document, and every position the source
map names holds the same token."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import torch

from dist_glm5.checkpoint.byte_chat import glm_call, simple_chat
from dist_glm5.launch.api.tool_calls import parse_tool_calls
from dist_glm5.train import chat_corpus as cc
from dist_glm5.train import trainer as td

WORDS = cc.Words(tuple("alpha beta gamma delta path value name count items limit".split()))
N = 300


def _text(doc: cc.ChatDoc) -> str:
    assert doc.ids[-1] == cc.EOS and cc.EOS not in doc.ids[:-1]
    return bytes(doc.ids[:-1]).decode()


def _assert_sources(doc: cc.ChatDoc) -> None:
    assert len(doc.src) == len(doc.ids)
    for t, s in enumerate(doc.src):
        if s >= 0:
            assert s < t and doc.ids[s] == doc.ids[t]


def test_tool_chats_render_as_the_server_does_and_every_call_parses_and_validates():
    rng = random.Random(0)
    n_calls = n_replies = 0
    for _ in range(N):
        doc = cc.ChatDoc()
        cc.tool_chat(rng, WORDS, doc)
        _assert_sources(doc)
        text = _text(doc)
        tools = json.loads(
            "[" + text.split("<tools>\n")[1].split("\n</tools>")[0].replace("\n", ",") + "]"
        )
        user = text.split("<|user|>\n")[1].split("\n<|assistant|>\n")[0]
        prompt = simple_chat([{"role": "user", "content": user}], tools)
        assert text.startswith(prompt)  # the server's rendering of the same request
        turn = text[len(prompt) :].split("\n<|observation|>")[0]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        content, calls = parse_tool_calls(turn, schemas)
        assert calls and "<tool_call>" not in content, turn
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            jsonschema.validate(args, schemas[c["function"]["name"]])
            # the corpus writes a call byte for byte as the server's format does
            assert glm_call({"name": c["function"]["name"], "arguments": args}) in turn
            n_calls += 1
        if "<|observation|>" in text:
            n_replies += 1
            result = text.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
            json.loads(result)
    assert n_calls >= N and 0.2 * N < n_replies < 0.6 * N


def test_json_replies_and_documents_parse():
    rng = random.Random(1)
    for _ in range(N):
        doc = cc.ChatDoc()
        cc.json_chat(rng, WORDS, doc)
        _assert_sources(doc)
        reply = _text(doc).split("<|assistant|>\n")[1]
        assert isinstance(json.loads(reply), dict)
        assert re.search(r"[,:] ", reply) is None or '"' in reply  # compact outside strings
        doc = cc.ChatDoc()
        cc.json_text(rng, WORDS, doc)
        assert isinstance(json.loads(bytes(doc.ids).decode()), dict)


def test_chat_rows_have_the_length_asked_and_their_sources_hold():
    rng = random.Random(2)
    code = b"def f(x):\n    return x\n\n" * 400
    for n in (512, 2048):
        ids, src = cc.chat_row(rng, WORDS, n, code)
        assert len(ids) == len(src) == n and (n < 2048 or cc.EOS in ids)
        for t, s in enumerate(src):
            assert s < 0 or ids[s] == ids[t]


def test_a_training_step_takes_rows_with_eos():
    """<eos> ids go through the LM loss and are left out of the byte read-outs (256 classes)."""
    from test_train_default import TINY

    tr = td.Trainer(td.hf_config(TINY), seed=0)
    tr.rows_gen.manual_seed(0)
    rows = []
    for i in range(2):
        rng, doc = random.Random(i), cc.ChatDoc()
        while len(doc.ids) < 96:  # short JSON chats: each ends with <eos>
            cc.json_chat(rng, WORDS, doc)
        rows.append((doc.ids[:96], doc.src[:96]))
    ids = torch.tensor([r[0] for r in rows])
    induction = torch.tensor([td.induction_targets(r[0], r[1]) for r in rows])
    assert (ids == cc.EOS).any()
    ls = tr.losses(ids)
    ls.update(tr.attention_supervision(ids, induction))
    assert all(torch.isfinite(v) for v in ls.values()), ls
