"""transformers' AutoTokenizer on a byte-vocabulary model directory (the random model's, written
by our writer as the trainer's export writes one) is our ByteTokenizer exactly: ids of any text
(multi-byte characters and the special tokens' text included), text of any id list (ids
splitting a UTF-8 character, special ids, both settings of skip_special_tokens), the vocabulary,
bos/eos/pad. Our own loader still takes ByteTokenizer there. The shipped directory, whatever its
vocabulary, is checked in test_trained_default.py.

transformers is a test dependency: without it this file fails (lm-eval and guidellm need it)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    from transformers import AutoTokenizer
except Exception as e:  # not a skip: a missing transformers must not turn this file green
    pytest.fail(f"transformers cannot be imported ({e}); pip install -e '.[test]'", pytrace=False)

from dist_glm5.checkpoint.default_model import ensure_random_model
from dist_glm5.checkpoint.tokenizer import (
    BYTE_TOKENIZER,
    CHAT_TAGS,
    ByteTokenizer,
    load_tokenizer,
    write_tokenizer_files,
)

OURS = ByteTokenizer()  # the random model's vocabulary: bytes and <bos> <eos> <pad>
V = OURS.vocab_size
SPECIAL_TEXT = ["<bos>", "<eos>", "<pad>", "<|endoftext|>", "[gMASK]", "<sop>", "<|user|>"]
SPECIAL_TEXT += ["<|assistant|>", "<|observation|>", "<|system|>", "<eos", "eos>", "<<eos>>"]
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def byte_dir():
    return ensure_random_model()


@pytest.fixture(scope="module")
def hf(byte_dir):
    return AutoTokenizer.from_pretrained(byte_dir)


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = (stdlib / "json" / "decoder.py").read_text(encoding="utf-8")
    texts = [
        "",
        " ",
        "  leading and trailing  ",
        "Hello, world!",
        "a\nb\r\nc\rd\te\x00f\x1b[0m\x7f",
        "naïve café, Ærøskøbing, Straße, ǅ, ﬁ",  # precomposed, ligatures
        "e\u0301 a\u0308 n\u0303",  # combining marks (no normalization)
        "日本語のテキスト、中文，한국어",
        "Ελληνικά, русский, עברית, العربية",
        "😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ♥️",  # 4-byte, modifiers, ZWJ, flags, variation selector
        "\ufeffBOM \ufffd replacement \u200b zero width \u2028 line sep",
        "\U0010ffff \U00010000 \u0800 \u07ff \x80 \xff",  # UTF-8 length boundaries
        "def f(x):\n    return x ** 2  # comment\n",
        code,
        code * 40,  # ~0.5 MB
    ]
    texts += SPECIAL_TEXT
    texts += ["x" + " ".join(SPECIAL_TEXT) + "y", "".join(SPECIAL_TEXT), "é<eos>€<bos>😀<pad>"]
    return texts


def check_text(hf, text: str, ours: ByteTokenizer = OURS) -> None:
    ids = ours.encode(text)
    assert hf.encode(text) == ids
    assert hf(text)["input_ids"] == ids
    assert hf.encode(text, add_special_tokens=False) == ids
    for skip in (True, False):
        assert hf.decode(ids, skip_special_tokens=skip) == text == ours.decode(ids, skip)


def check_ids(hf, ids: list[int], ours: ByteTokenizer = OURS) -> None:
    for skip in (True, False):
        assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip), (ids, skip)


# ---- the directory -------------------------------------------------------------------------------
def test_our_loader_keeps_the_byte_tokenizer(byte_dir):
    back = load_tokenizer(byte_dir)
    assert type(back) is ByteTokenizer and back.vocab_size == V
    assert (back.space_runs, back.chat_tags, back.space_unit) == (0, False, 0)
    assert (byte_dir / "tokenizer.json").exists()


def test_vocabulary_and_special_tokens(hf, byte_dir):
    cfg = json.loads((byte_dir / "config.json").read_text())
    assert len(hf) == V == cfg["vocab_size"] == 259
    assert hf.bos_token_id == OURS.bos_id == cfg["bos_token_id"]
    assert [hf.eos_token_id] == [OURS.eos_id] == cfg["eos_token_id"]
    assert hf.pad_token_id == OURS.pad_id == cfg["pad_token_id"]
    special = {i: OURS.SPECIAL[i] for i in sorted(OURS.SPECIAL)}
    assert dict(zip(hf.all_special_ids, hf.all_special_tokens, strict=True)) == special
    assert hf.convert_ids_to_tokens(list(special)) == list(special.values())
    assert sorted(hf.get_vocab().values()) == list(range(V))
    # the chat template: the same as the directory's (none: our server writes role tags itself)
    tc = json.loads((byte_dir / "tokenizer_config.json").read_text())
    assert hf.chat_template == tc.get("chat_template") is None
    assert not (byte_dir / "chat_template.jinja").exists()


def test_every_single_byte_and_special_id(hf):
    for i in range(V):
        check_ids(hf, [i])
        check_ids(hf, [65, i, 66])
    assert [hf.convert_tokens_to_ids(t) for t in hf.convert_ids_to_tokens(list(range(V)))] == (
        list(range(V))
    )


# ---- encode --------------------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(len(corpus())))
def test_corpus(hf, i):
    check_text(hf, corpus()[i])


def test_batch(hf):
    texts = corpus()[:20]
    assert hf(texts)["input_ids"] == [OURS.encode(t) for t in texts]
    ids = [OURS.encode(t) for t in texts]
    assert hf.batch_decode(ids) == texts


@SETTINGS
@given(st.text())
def test_any_text(hf, text):
    check_text(hf, text)


@SETTINGS
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_TEXT)), max_size=12))
def test_text_around_special_tokens_text(hf, parts):
    check_text(hf, "".join(parts))


# ---- decode --------------------------------------------------------------------------------------
UTF8_SPLITS = [
    [0xE2, 257, 0x82, 0xAC],  # "€" cut by a special token
    [0xF0, 0x9F, 256, 0x98, 0x80, 258],  # "😀" likewise
    [0xE2, 0x82],  # truncated at the end
    [0x82, 0xAC, 104],  # continuation bytes first
    [0xC0, 0x80, 0xED, 0xA0, 0x80, 0xF4, 0x90, 0x80, 0x80, 0xF5, 0xFF],  # overlong, surrogate, >max
    [0xF0, 0x9F, 0x98, 0x41, 0xE2, 0x28, 0xA1],  # invalid continuations
]


@pytest.mark.parametrize("ids", UTF8_SPLITS)
def test_ids_splitting_characters(hf, ids):
    check_ids(hf, ids)


@SETTINGS
@given(st.lists(st.integers(0, V - 1), max_size=64))
def test_any_ids(hf, ids):
    check_ids(hf, ids)


# mostly the bytes of multi-byte characters (leads and continuations) and the special ids
NON_ASCII = st.one_of(st.integers(0x80, 0xFF), st.integers(0x80, 0xBF), st.integers(256, 258))


@SETTINGS
@given(st.lists(st.one_of(NON_ASCII, st.integers(0, V - 1)), max_size=64))
def test_ids_mostly_non_ascii(hf, ids):
    check_ids(hf, ids)


@SETTINGS
@given(st.text(min_size=1), st.data())
def test_characters_cut_anywhere(hf, text, data):
    ids = OURS.encode(text)
    at = data.draw(st.lists(st.integers(0, len(ids)), max_size=4))
    for i in sorted(at, reverse=True):
        ids.insert(i, data.draw(st.integers(256, 258)))
    check_ids(hf, ids)
    check_ids(hf, ids[: data.draw(st.integers(0, len(ids)))])


# ---- the writer (the trainer's export and the random model use it) -------------------------------
def test_written_byte_files(tmp_path):
    write_tokenizer_files(tmp_path, ByteTokenizer())
    new = json.loads((tmp_path / "tokenizer.json").read_text())
    assert new["model"]["type"] == "BPE" and new["model"].get("merges", []) == []  # bytes only
    assert sorted(new["model"]["vocab"].values()) == list(range(256))
    assert [t["content"] for t in new["added_tokens"]] == ["<bos>", "<eos>", "<pad>"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] != (
        BYTE_TOKENIZER
    )


def test_random_model_directory():
    d = ensure_random_model()
    assert type(load_tokenizer(d)) is ByteTokenizer
    hf = AutoTokenizer.from_pretrained(d)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, len(hf)) == (256, 257, 258, 259)
    for text in corpus()[:-2]:
        check_text(hf, text, ByteTokenizer())
    for ids in UTF8_SPLITS:
        check_ids(hf, ids, ByteTokenizer())


def test_old_directory_still_takes_the_byte_tokenizer(tmp_path):
    """A directory written before (only {"tokenizer_class": BYTE_TOKENIZER})."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": BYTE_TOKENIZER}))
    assert type(load_tokenizer(tmp_path)) is ByteTokenizer


# ---- space runs (a trainer run's --space-runs) ---------------------------------------------------
RUNS = ByteTokenizer(16)


def test_space_runs_are_one_id_each_longest_first():
    assert RUNS.vocab_size == 259 + 15
    text = "if x:\n" + " " * 8 + "y  = 1" + " " * 17 + "#\n" + " " * 40 + "z"
    want = list(b"if x:\n") + [257 + 8] + list(b"y") + [257 + 2] + list(b"= 1")
    want += [257 + 16] + list(b" #\n") + [257 + 16, 257 + 16, 257 + 8] + list(b"z")
    assert RUNS.encode(text) == want
    assert RUNS.decode(want) == text
    assert RUNS.token_bytes()[257 + 5] == b"     "


def _merging_is_encoding(tok: ByteTokenizer, ids: list[int]) -> None:
    """merge (the trainer's, on ids with special ids among them) against the tokenizer's regex
    on bytes, piece by piece between the special ids; starts map back."""
    got, starts = tok.merge(ids)
    want, piece = [], []
    for i in [*ids, None]:
        if i is None or i >= 256:
            want += tok.encode_bytes(bytes(piece)) + ([] if i is None else [i])
            piece = []
        else:
            piece.append(i)
    assert got == want
    tb = tok.token_bytes()
    assert [b for i in got for b in tb[i]] == [b for i in ids for b in tb[i]]
    assert all(ids[s] == (g if g in (256, 257) else tb[g][0]) for g, s in zip(got, starts))


@SETTINGS
@given(st.lists(st.sampled_from([32, 32, 32, 10, 97, 256, 257]), max_size=80))
def test_merging_ids_is_encoding_their_bytes(ids):
    _merging_is_encoding(RUNS, ids)


# ---- a space unit (a trainer run's --space-unit) -------------------------------------------
UNIT = ByteTokenizer(space_unit=4)


def test_a_space_unit_is_one_id_for_exactly_its_spaces_from_the_left():
    assert UNIT.vocab_size == 260 and UNIT.token_bytes()[259] == b"    "
    text = "if x:\n" + " " * 8 + "y  = 1" + " " * 9 + "#\n" + " " * 3 + "z"
    want = list(b"if x:\n") + [259, 259] + list(b"y  = 1") + [259, 259, 32]
    want += list(b"#\n   z")
    assert UNIT.encode(text) == want
    assert UNIT.decode(want) == text
    assert ByteTokenizer(space_unit=4, chat_tags=True).tag_id("<|system|>") == 260
    with pytest.raises(ValueError, match="two vocabularies"):
        ByteTokenizer(16, space_unit=4)
    with pytest.raises(ValueError, match="no id holds a run of 3"):
        UNIT.run_id(3)


@SETTINGS
@given(st.lists(st.sampled_from([32, 32, 32, 10, 97, 256, 257]), max_size=80))
def test_merging_ids_into_a_space_unit_is_encoding_their_bytes(ids):
    _merging_is_encoding(UNIT, ids)


SPACE_IDS = {"runs": RUNS, "unit": UNIT}


@pytest.fixture(scope="module", params=list(SPACE_IDS))
def hf_spaces(request, tmp_path_factory):
    """(ours, its directory, transformers' tokenizer of that directory), for either vocabulary
    with space ids."""
    tok = SPACE_IDS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    write_tokenizer_files(d, tok)
    return tok, d, AutoTokenizer.from_pretrained(d)


def test_space_ids_directory_is_transformers_tokenizer_exactly(hf_spaces):
    tok, d, hf = hf_spaces
    ours, n = load_tokenizer(d), tok.vocab_size
    assert type(ours) is ByteTokenizer
    assert (ours.space_runs, ours.space_unit) == (tok.space_runs, tok.space_unit)
    assert (len(hf), hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (n, 256, 257, 258)
    assert sorted(hf.get_vocab().values()) == list(range(n))
    for text in corpus() + ["  ", " " * 33, "a" + " " * 17 + "b", "\t  \t   x", "\t    \t     x"]:
        ids = tok.encode(text)
        assert hf.encode(text) == ids == ours.encode(text)
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip)
    for i in range(n):
        assert hf.decode([65, i, 66], skip_special_tokens=False) == tok.decode([65, i, 66], False)


@SETTINGS
@given(st.text(alphabet=st.sampled_from(" \n\tab<eos>é😀"), max_size=120))
def test_space_ids_any_text(hf_spaces, text):
    tok, _, hf = hf_spaces
    assert hf.encode(text) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text


# ---- chat tags (a trainer run's --chat-tags) ------------------------------------------------
TAGGED = ByteTokenizer(16, chat_tags=True)


@pytest.fixture(scope="module")
def hf_tags(tmp_path_factory):
    d = tmp_path_factory.mktemp("tags")
    write_tokenizer_files(d, TAGGED)
    return d, AutoTokenizer.from_pretrained(d)


def test_chat_tags_are_one_id_each_after_the_runs():
    assert TAGGED.vocab_size == 274 + len(CHAT_TAGS) == 286
    assert ByteTokenizer(0, chat_tags=True).tag_id("<|system|>") == 259  # no runs: after <pad>
    text = "<tool_call>f<arg_key>k</arg_key><arg_value>  v</arg_value></tool_call><tool_call"
    v, t = TAGGED.tag_id, TAGGED.tag_id
    want = [t("<tool_call>"), 102, t("<arg_key>"), 107, t("</arg_key>"), t("<arg_value>")]
    want += [257 + 2, 118, v("</arg_value>"), v("</tool_call>")] + list(b"<tool_call")
    assert TAGGED.encode(text) == want  # a tag cut short stays bytes
    assert TAGGED.decode(want) == text
    assert [TAGGED.token_bytes()[TAGGED.tag_id(x)] for x in CHAT_TAGS] == [
        x.encode() for x in CHAT_TAGS
    ]


PIECES = [[i] for i in b"<>/|_ ak"] + [[256], [257], [32, 32, 32]]
PIECES += [list(t) for t in (b"<arg_key>", b"</arg_value>", b"<|user|>", b"</arg_value")]


@SETTINGS
@given(st.lists(st.sampled_from(PIECES), max_size=30).map(lambda ps: [i for p in ps for i in p]))
def test_merging_ids_with_tags_is_encoding_their_bytes(ids):
    _merging_is_encoding(TAGGED, ids)


def test_chat_tags_directory_is_transformers_tokenizer_exactly(hf_tags):
    from dist_glm5.checkpoint.byte_chat import simple_chat

    d, hf = hf_tags
    ours = load_tokenizer(d)
    assert type(ours) is ByteTokenizer and (ours.space_runs, ours.chat_tags) == (16, True)
    assert sorted(hf.get_vocab().values()) == list(range(286))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = simple_chat(
        [
            {"role": "user", "content": "Call f  now <|user|> <arg_value>"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]},
            {"role": "tool", "content": '{"ok": true}'},
        ],
        tools,
    )
    for text in [*corpus(), chat, "<tool_call><tool_call>x</tool_call", "<|assistant|><eos>"]:
        ids = TAGGED.encode(text)
        assert hf.encode(text) == ids == ours.encode(text)
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == TAGGED.decode(ids, skip)
    assert TAGGED.tag_id("<|assistant|>") in TAGGED.encode(chat)


@SETTINGS
@given(
    st.lists(
        st.sampled_from(
            ["<tool_call>", "</arg_value>", "<|user|>", "<", "/", " ", "a", "é", "<eos>"]
        ),
        max_size=40,
    ).map("".join)
)
def test_chat_tags_any_text(hf_tags, text):
    assert hf_tags[1].encode(text) == TAGGED.encode(text)
    assert TAGGED.decode(TAGGED.encode(text)) == text
