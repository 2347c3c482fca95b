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


def _messages(text: str, schemas: dict) -> list[dict]:
    """The chat after the tools' listing, read back as OpenAI messages: the user's, the
    assistant's (its content and its calls, parsed by the server's reader) and the tools'."""
    parts = re.split(r"<\|(user|assistant|observation)\|>\n", text)[1:]
    out = []
    for role, body in zip(parts[::2], parts[1::2]):
        body = body[:-1] if body.endswith("\n") else body  # each turn ends with a newline
        if role == "observation":
            result = body.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
            out.append({"role": "tool", "content": result})
        elif role == "assistant":
            content, calls = parse_tool_calls(body, schemas)
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in calls
            ]
            out.append({"role": "assistant", "content": content, "tool_calls": calls})
        else:
            out.append({"role": "user", "content": body})
    return out


def test_tool_chats_render_as_the_server_does_and_every_call_parses_and_validates():
    rng = random.Random(0)
    n_calls = n_replies = n_rounds = 0
    for _ in range(N):
        doc = cc.ChatDoc()
        cc.tool_chat(rng, WORDS, doc)
        _assert_sources(doc)
        text = _text(doc)
        tools = json.loads(
            "[" + text.split("<tools>\n")[1].split("\n</tools>")[0].replace("\n", ",") + "]"
        )
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        messages = _messages(text, schemas)
        # the server renders the same chat up to the last assistant turn, byte for byte
        prompt = simple_chat(messages[:-1], tools)
        assert text.startswith(prompt), (prompt, text)
        assert simple_chat(messages, tools, add_generation_prompt=False) == text + "\n"
        n_rounds += sum(m["role"] == "user" for m in messages)
        for m in messages:
            if m["role"] == "tool":
                n_replies += 1
                json.loads(m["content"])
            if m["role"] != "assistant" or not m["tool_calls"]:
                continue
            assert "<tool_call>" not in m["content"]
            for c in m["tool_calls"]:
                jsonschema.validate(c["arguments"], schemas[c["name"]])
                assert glm_call(c) in text  # byte for byte as the server's format writes it
                n_calls += 1
    assert n_calls >= n_rounds > 1.5 * N and 0.5 * N < n_replies < n_rounds


def test_the_assistants_ids_are_marked_and_no_others():
    """Every assistant turn (from after its role tag to <eos> or the next role tag) is marked
    `reply`, and nothing the user, the system or a tool wrote is."""
    rng = random.Random(3)
    for make in (cc.tool_chat, cc.json_chat):
        for _ in range(100):
            doc = cc.ChatDoc()
            make(rng, WORDS, doc)
            text = bytes(i if i < 256 else 0 for i in doc.ids)
            want = [False] * len(text)
            for m in re.finditer(rb"<\|assistant\|>\n", text):
                end = len(text)
                for tag in (b"\n<|user|>", b"<tool_response>"):
                    k = text.find(tag, m.end())
                    end = min(end, k if k >= 0 else end)
                want[m.end() : end] = [True] * (end - m.end())
            assert doc.reply == want, text


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
        ids, src, reply = cc.chat_row(rng, WORDS, n, code)
        assert len(ids) == len(src) == len(reply) == n and (n < 2048 or cc.EOS in ids)
        assert any(reply) and not all(reply)
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
        rows.append((doc.ids[:96], doc.src[:96], doc.reply[:96]))
    ids = torch.tensor([r[0] for r in rows])
    induction = torch.tensor([td.induction_targets(r[0], r[1]) for r in rows])
    reply = torch.tensor([r[2] for r in rows])
    assert (ids == cc.EOS).any()
    ls = tr.losses(ids)
    ls.update(tr.attention_supervision(ids, induction))
    ls["reply"] = tr.reply_loss(ids, reply)
    assert all(torch.isfinite(v) for v in ls.values()), ls
    # the reply loss is the LM loss over the assistant's ids alone, written out
    lp = torch.log_softmax(tr.logits[:, :-1].float(), -1)
    nll = -lp.gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(ls["reply"], nll[reply[:, 1:]].mean(), rtol=1e-5)
    assert float(tr.reply_loss(ids, torch.zeros_like(reply))) == 0.0


def test_relative_paths_leave_no_value_beginning_with_a_slash():
    """A leading "/" began about a tenth of the free values (the control), more than any word or
    name; with relative_paths the paths stay (`reports/city.txt`) and none begins with it."""
    import dataclasses

    draws = {}
    for rel in (False, True):
        rng, w = random.Random(3), dataclasses.replace(WORDS, relative_paths=rel)
        draws[rel] = [cc.free_string(rng, w) for _ in range(5000)]
    slash = {rel: sum(v.startswith("/") for v in vs) / len(vs) for rel, vs in draws.items()}
    assert 0.07 < slash[False] < 0.13 and slash[True] == 0
    paths = [v for v in draws[True] if v.endswith(".txt")]
    assert len(paths) > 300 and all(re.fullmatch(r"[a-z]+(/[a-z]+){0,2}\.txt", p) for p in paths)


def test_data_passes_relative_paths_to_the_chats_words():
    assert (
        not td.Data(1).words.relative_paths and td.Data(1, relative_paths=True).words.relative_paths
    )
