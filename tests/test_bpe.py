"""The BPE vocabulary of checkpoint/bpe.py against code nobody here wrote and written-out rules:
- its merges are those of the plain BPE rule (recount every pair, merge the most frequent; ties:
  the smaller bytes), recomputed here step by step;
- transformers' AutoTokenizer on the files it writes encodes any text (code, multi-byte
  characters, chat tags, the special tokens' text) to its ids and decodes any ids to its text;
- our loader reads those files back to the same tokenizer; merge() keeps a row's special ids and
  says where each id starts; a training row of needles keeps its answers.

transformers is the oracle (conftest.require: under CI a failed import fails)."""

from __future__ import annotations

import random
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
from conftest import require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_glm5.checkpoint.bpe import BpeTokenizer, pieces, train_merges
from dist_glm5.checkpoint.tokenizer import (
    CHAT_TAGS,
    FIRST_RUN_ID,
    load_tokenizer,
    write_tokenizer_files,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CODE = b"\n".join((STDLIB / f).read_bytes() for f in ("json/decoder.py", "json/encoder.py"))
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL_TEXT = ["<bos>", "<eos>", "<pad>", "<eos", "<<eos>>", *CHAT_TAGS, "</tool_call", "<|"]


@pytest.fixture(scope="module")
def tok() -> BpeTokenizer:
    return BpeTokenizer(train_merges(CODE, 300))


@pytest.fixture(scope="module")
def hf(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    write_tokenizer_files(d, tok)
    return require("transformers").AutoTokenizer.from_pretrained(d)


def plain_merges(data: bytes, n_tokens: int) -> list[tuple[bytes, bytes]]:
    """The BPE rule as written: every step recounts all adjacent pairs of every piece and
    merges the most frequent (ties: the smaller pair of bytes) everywhere, left to right."""
    words = [[bytes([b]) for b in w] for w in pieces(data)]
    merges, made = [], set()
    while len(made) < n_tokens:
        n = Counter(p for w in words for p in zip(w, w[1:], strict=False))
        if not n:
            break
        best = min(n, key=lambda p: (-n[p], p))
        merges.append(best)
        made.add(best[0] + best[1])
        for i, w in enumerate(words):
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(w[j] + w[j + 1])
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
    return merges


def test_merges_are_the_plain_rule():
    data = CODE[:20000]
    assert train_merges(data, 120) == plain_merges(data, 120)


def test_pieces_cover_every_byte_and_keep_indentation_steps():
    data = bytes(range(256)) + b"\n        x  = 1\t\r\n   y" + CODE[:3000]
    assert b"".join(pieces(data)) == data
    assert pieces(b"        return x") == [b"    ", b"    ", b"return", b" x"]


def test_ids_layout(tok):
    assert tok.vocab_size == FIRST_RUN_ID + len(CHAT_TAGS) + len(tok.merged)
    assert [tok.tag_id(t) for t in CHAT_TAGS] == list(range(259, 259 + len(CHAT_TAGS)))
    tb = tok.token_bytes()
    assert tb[:256] == [bytes([b]) for b in range(256)] and len(tb) == tok.vocab_size
    assert len(set(tb[tok.first_merged_id :])) == len(tok.merged)  # no piece twice


def check_text(hf, tok, text: str) -> None:
    ids = tok.encode(text)
    assert hf.encode(text) == ids
    assert b"".join(tok.token_bytes()[i] for i in ids) == text.encode()
    for skip in (True, False):
        assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip)


def corpus() -> list[str]:
    texts = [
        "",
        " ",
        "  x  ",
        "a\nb\r\nc\td\x00\x7f",
        "naïve café 日本語 😀 👨‍👩‍👧",
        "\U0010ffff \x80",
    ]
    texts += [CODE.decode()[:5000], (STDLIB / "textwrap.py").read_text(), *SPECIAL_TEXT]
    texts += ["x" + " ".join(SPECIAL_TEXT) + "y", "<|user|>hi<tool_call>f<arg_key>a</arg_key>"]
    return texts


@pytest.mark.parametrize("i", range(len(corpus())))
def test_transformers_encodes_as_we_do(hf, tok, i):
    check_text(hf, tok, corpus()[i])


@SETTINGS
@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_TEXT)), max_size=12))
def test_any_text(hf, tok, parts):
    check_text(hf, tok, "".join(parts))


@SETTINGS
@given(st.data())
def test_any_ids(hf, tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=48))
    for skip in (True, False):
        assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip), (ids, skip)


def test_our_loader_reads_it_back(tok, tmp_path):
    write_tokenizer_files(tmp_path, tok)
    back = load_tokenizer(tmp_path)
    assert type(back) is BpeTokenizer and back.merge_list == tok.merge_list
    text = CODE.decode()
    assert back.encode(text) == tok.encode(text)


def test_merge_keeps_special_ids_and_says_where_ids_start(tok):
    row = list(b"def f():\n    return 1\n") + [257] + list(b"<|user|>abc  d") + [256]
    ids, starts = tok.merge(row)
    assert ids[ids.index(257) + 1] == tok.tag_id("<|user|>") and ids[-1] == 256
    ends = [*starts[1:], len(row)]
    for i, a, b in zip(ids, starts, ends, strict=True):
        assert (bytes(row[a:b]) if i < 256 or i > 258 else None) in (tok.token_bytes()[i], None)
        assert i not in (256, 257) or row[a] == i


def test_a_needle_row_keeps_its_answers(tok):
    from dist_glm5.train.trainer import MIXES, Data

    data = Data(3, True, tok, 2)
    data.window = lambda rng, n: (CODE * (1 + 4 * n // len(CODE)))[:n]  # a tiny corpus
    mix = dict(MIXES["base"], needle=1.0)
    MIXES["needle-only"] = mix
    try:
        for step in range(6):
            ids, ind, _ = data.row(random.Random(step), 256, "needle-only")
            text = tok.decode(ids)
            asked = [line for line in text.split("\n") if line.startswith("[key ")]
            assert len(ids) == 256 and len(asked) >= 4 and len(asked) % 2 == 0, text[-300:]
            assert sorted(asked[: len(asked) // 2]) == sorted(asked[len(asked) // 2 :])
            assert max(ind) >= 0  # the answers' ids point back at their needles
    finally:
        del MIXES["needle-only"]


def test_a_bpe_run_takes_no_other_vocabulary_flags():
    from dist_glm5.train.trainer import RunShape

    with pytest.raises(ValueError, match="--bpe is a vocabulary of its own"):
        RunShape(space_unit=4, bpe=2048)


# ---- a model with this vocabulary, served -------------------------------------------------------
@pytest.fixture(scope="module")
def bpe_server(tok, tmp_path_factory):
    """The random model's architecture with tok's vocabulary, random weights, behind the API."""
    import json

    from runtime_util import coordinator
    from test_api_tools import start_server

    from dist_glm5.checkpoint.default_model import CONFIG_PATH, random_weights
    from dist_glm5.checkpoint.safetensors_io import save_streaming
    from dist_glm5.engine.config import CacheConfig
    from dist_glm5.engine.loop import EngineLoop
    from dist_glm5.launch.api.engine_request import ModelInfo
    from dist_glm5.model.config import ModelConfig

    d = tmp_path_factory.mktemp("bpe-model")
    raw = dict(json.loads(CONFIG_PATH.read_text()), vocab_size=tok.vocab_size)
    (d / "config.json").write_text(json.dumps(raw))
    write_tokenizer_files(d, tok)
    save_streaming(d / "model.safetensors", random_weights(ModelConfig.from_hf(raw), 5))
    c = coordinator(d, cache=CacheConfig(256), max_model_len=1024)
    loop = EngineLoop(c)
    srv = start_server(loop, ModelInfo.from_model_dir(d, "bpe", 1024, tok.vocab_size, c.tokenizer))
    yield srv
    srv.stop()
    srv.client.close()
    loop.close()


def test_a_bpe_model_serves_calls_text_and_logprobs(bpe_server, tok):
    import json

    openai = require("openai")
    oc = openai.OpenAI(base_url=bpe_server.url + "/v1", api_key="none", max_retries=0)
    fn = {
        "name": "wx",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    }
    r = oc.chat.completions.create(
        model="bpe",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[{"type": "function", "function": fn}],
        tool_choice={"type": "function", "function": {"name": "wx"}},
        max_tokens=64,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0].function
    assert r.choices[0].finish_reason == "tool_calls" and call.name == "wx"
    args = json.loads(call.arguments)
    assert set(args) == {"city", "days"} and len(args["city"]) <= 6 and type(args["days"]) is int
    kw = dict(model="bpe", prompt="def f(x):\n    return", max_tokens=24, temperature=0)
    c = oc.completions.create(**kw)
    assert c.usage.completion_tokens == 24 and c.choices[0].text
    streamed = "".join(x.choices[0].text for x in oc.completions.create(**kw, stream=True))
    assert streamed == c.choices[0].text
    # chat logprobs' bytes are each id's own (a piece may hold part of a character); a sampled
    # special id (`<bos>`) has its entry, as vLLM's does, but no text in the content
    for seed in range(4):
        r = oc.chat.completions.create(
            model="bpe",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            logprobs=True,
            seed=seed,
        )
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        got = b"".join(bytes(e.bytes) for e in content if e.token not in tok.SPECIAL.values())
        assert got.decode("utf-8", "replace") == r.choices[0].message.content


def test_a_needle_question_ends_where_a_piece_ends(tok):
    """bench quality asks `[key 4821:` and the answer is ` tayk45`: the question's ids are the
    first ids of question + answer (asked with the space, a BPE model would read ` ` where its
    training read ` t`, a piece it never saw split)."""
    from dist_glm5.bench.quality import needle_prompts

    assert tok.encode(" t")[0] == tok.encode(" tayk45")[0] != tok.encode(" ")[0]  # the control
    split = 0
    for kind in ("code", "prose"):
        asks, answers = needle_prompts(1024, kind, seed=7)
        for ask, answer in zip(asks, answers):
            assert ask.endswith(b":") and answer.startswith(" ")
            ids = tok.encode_bytes(ask)
            assert tok.encode_bytes(ask + answer.encode())[: len(ids)] == ids
            spaced = tok.encode_bytes(ask + b" ")
            split += tok.encode_bytes(ask + answer.encode())[: len(spaced)] != spaced
    assert split  # the old question (ending in the space) splits some answer's first piece
