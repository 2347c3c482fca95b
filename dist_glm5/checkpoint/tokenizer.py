"""Tokenizers: the byte-level one of the embedded model, or a checkpoint's tokenizer.json.

A directory holding the byte tokenizer also carries, for transformers' `AutoTokenizer` (lm-eval,
guidellm), a tokenizer.json that is the same tokenizer (`write_tokenizer_files`): the 256 bytes as
ids 0..255 (BPE with no merges over the byte-level alphabet) and the special tokens after them,
whose text in the input is encoded as its bytes (`split_special_tokens` in tokenizer_config.json,
as ours does; the `tokenizers` library alone, not reading that file, gives "<eos>" in a text id
257). Our loader still picks `ByteTokenizer` there, by tokenizer_config.json's
`dist_glm5_tokenizer` key.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

BYTE_TOKENIZER = "DistGlm5ByteTokenizer"
BPE_TOKENIZER = "DistGlm5BpeTokenizer"  # checkpoint/bpe.py
MARKER = "dist_glm5_tokenizer"  # the tokenizer_config.json key naming ours (for our loader)
RUNS_KEY = "dist_glm5_space_runs"  # and its longest space run (absent: 0, bytes only)
UNIT_KEY = "dist_glm5_space_unit"  # or its one run length (absent: 0)
TAGS_KEY = "dist_glm5_chat_tags"  # and whether CHAT_TAGS are ids (absent: false)
# the space-run ids come right after <bos> <eos> <pad>, shortest first (with space_runs R, a run of
# k spaces is id 257 + k)
FIRST_RUN_ID = 259
# the chat format's tags (byte_chat.simple_chat), one id each after the runs: GLM's tokenizer has
# them as single tokens too
CHAT_TAGS = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)


ENCODE_PIECE = 1 << 18  # bytes listed per call: a 4 MB prompt would hold the GIL ~100 ms at once


class ByteTokenizer:
    """ids 0..255 are bytes; then <bos>, <eos>, <pad>; then, with space_runs R > 1, runs of 2..R
    spaces (id 257 + k for a run of k), taken greedily from the left, or, with space_unit U > 1,
    one id (259) for exactly U spaces, taken U at a time from the left (a run of 9 with U = 4:
    two ids and a space); then, with chat_tags, one id per tag of CHAT_TAGS. Needs no download.

    Why runs: a byte model chooses an indentation one space at a time, and greedy decoding of
    the trained default model kept choosing "one more" (96 spaces after a line of code). With a
    run one id, the indentation is one choice, and after a run (longest first) comes no space.
    Why tags: in bytes, `<arg_value>` and `</arg_value>` end with the same 10 bytes, and a model
    that missed the `/` 11 bytes back closed a call where its value should start; one id each,
    the previous id tells them apart. Why a unit: with every run one id, the inner runs were
    merged too and the draft lost its easiest tokens (docs/trained_default.md, b1); with one id
    per indentation step, an indentation is a few ids a head can count, each after the first an
    easy draft. GLM's own tokenizer has whitespace-run and tag ids too."""

    SPECIAL = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

    def __init__(self, space_runs: int = 0, chat_tags: bool = False, space_unit: int = 0) -> None:
        if space_runs < 0 or space_runs == 1:
            raise ValueError(f"space_runs={space_runs}: 0 (bytes only) or the longest run, >= 2")
        if space_unit < 0 or space_unit == 1:
            raise ValueError(f"space_unit={space_unit}: 0 (none) or the run length of its id, >= 2")
        if space_runs and space_unit:
            raise ValueError("space_runs and space_unit are two vocabularies: give one of them")
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.space_runs, self.chat_tags, self.space_unit = space_runs, chat_tags, space_unit
        # the lengths of the runs that are ids, in id order
        units = range(space_unit, space_unit + 1) if space_unit else range(0)
        self.run_lengths = range(2, space_runs + 1) if space_runs else units
        self.first_tag_id = FIRST_RUN_ID + len(self.run_lengths)
        self.tags = CHAT_TAGS if chat_tags else ()
        self.vocab_size = self.first_tag_id + len(self.tags)
        self._tag_ids = {t.encode(): self.first_tag_id + i for i, t in enumerate(self.tags)}
        pieces = [re.escape(t) for t in self._tag_ids]
        if self.run_lengths:  # greedy: the longest run that is an id (runs) or the unit
            pieces.append(rb" {%d,%d}" % (self.run_lengths[0], self.run_lengths[-1]))
        self._pieces = re.compile(b"|".join(pieces)) if pieces else None
        self._bytes = self.token_bytes()

    @property
    def space_ids(self) -> bool:
        """Are runs of spaces ids (space_runs or space_unit)?"""
        return bool(self.run_lengths)

    @property
    def merges(self) -> bool:
        """Does an id ever hold more than one byte (runs or tags)?"""
        return self._pieces is not None

    def run_id(self, k: int) -> int:
        """The id of a run of k spaces (k in run_lengths)."""
        if k not in self.run_lengths:
            raise ValueError(f"no id holds a run of {k} spaces (runs: {list(self.run_lengths)})")
        return FIRST_RUN_ID + self.run_lengths.index(k)

    def tag_id(self, tag: str) -> int:
        return self._tag_ids[tag.encode()]

    def encode(self, text: str) -> list[int]:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        if self._pieces is not None:  # the regex's leftmost pieces are merge()'s exactly
            out, i = [], 0
            for m in self._pieces.finditer(data):
                out += data[i : m.start()]
                piece = m.group(0)
                out.append(self._tag_ids.get(piece) or self.run_id(len(piece)))
                i = m.end()
            return out + list(data[i:])
        if len(data) <= ENCODE_PIECE:
            return list(data)
        out: list[int] = []
        for i in range(0, len(data), ENCODE_PIECE):  # pieces: another thread gets the GIL between
            out += data[i : i + ENCODE_PIECE]
        return out

    def merge(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """ids (bytes, special ids among them) -> (the ids this tokenizer reads them as: every
        tag one id, every run of 2..space_runs spaces one id, longest first from the left, or
        every space_unit spaces one id from the left; where each new id starts in the old ids)."""
        out, starts, i, n = [], [], 0, len(ids)
        tags = self._tag_ids
        while i < n:
            k, new = 1, ids[i]
            if new == 60 and tags:  # "<": a tag?
                for tb, tid in tags.items():
                    if ids[i : i + len(tb)] == list(tb):
                        k, new = len(tb), tid
                        break
            elif new == 32 and self.run_lengths:  # the regex's " {lo,hi}", greedy
                lo, hi = self.run_lengths[0], self.run_lengths[-1]
                while k < hi and i + k < n and ids[i + k] == 32:
                    k += 1
                if k >= lo:
                    new = self.run_id(k)
                else:  # too short for an id: one space
                    k = 1
            out.append(new)
            starts.append(i)
            i += k
        return out, starts

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes, in id order (what a grammar engine indexes: sampling/grammar.py)."""
        runs = [b" " * k for k in self.run_lengths]
        specials = [b"<bos>", b"<eos>", b"<pad>"]
        return [bytes([i]) for i in range(256)] + specials + runs + list(self._tag_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        b = self._bytes
        if skip_special_tokens:
            return b"".join(b[i] for i in ids if i not in self.SPECIAL).decode("utf-8", "replace")
        out, run = [], bytearray()
        for i in ids:
            if i not in self.SPECIAL:
                run += b[i]
                continue
            out += [run.decode("utf-8", errors="replace"), self.SPECIAL[i]]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

    def hf_files(self) -> dict[str, str]:
        """tokenizer.json and tokenizer_config.json of this tokenizer, in writing order."""
        cfg = json.dumps(hf_tokenizer_config(self), indent=2) + "\n"
        return {"tokenizer.json": hf_tokenizer_json(self), "tokenizer_config.json": cfg}


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # optional dependency, only for real checkpoints

        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def tokenizer_json(self) -> str:
        """The tokenizer.json text (what a grammar engine indexes: sampling/grammar.py)."""
        return self.tok.to_str()


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, or None when it ships none (then only token ids work)."""
    d = Path(model_dir)
    tc = d / "tokenizer_config.json"
    if tc.exists():
        cfg = json.loads(tc.read_text())
        if cfg.get(MARKER) == BPE_TOKENIZER:
            from .bpe import from_tokenizer_json

            return from_tokenizer_json((d / "tokenizer.json").read_text(encoding="utf-8"))
        if BYTE_TOKENIZER in (cfg.get(MARKER), cfg.get("tokenizer_class")):  # the latter: old dirs
            runs, tags, unit = cfg.get(RUNS_KEY, 0), cfg.get(TAGS_KEY, False), cfg.get(UNIT_KEY, 0)
            return ByteTokenizer(int(runs), bool(tags), int(unit))
    if (d / "tokenizer.json").exists():
        return HFTokenizer(d / "tokenizer.json")
    return None


# ---- the byte tokenizer as transformers' files ---------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (that of tokenizers' ByteLevel pre-tokenizer and decoder): a
    printable character per byte."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return dict(sorted(out.items()))


def hf_tokenizer_json(bt: ByteTokenizer) -> str:
    """tokenizer.json (Hugging Face tokenizers) equal to bt: ids and text alike."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    uni = _bytes_to_unicode()
    vocab = {ch: b for b, ch in uni.items()}
    specials = [bt.SPECIAL[i] for i in sorted(bt.SPECIAL)]
    if bt.merges:
        # every piece one id: a tag, a run of spaces (longest first) or one byte's character (a
        # tag's characters are printable ASCII: byte-level keeps them as they are)
        vocab.update({t: i for i, t in bt.SPECIAL.items()})
        vocab.update({uni[32] * k: bt.run_id(k) for k in bt.run_lengths})
        vocab.update({t: bt.tag_id(t) for t in bt.tags})
        pieces = [re.escape(t) for t in bt.tags]
        if bt.run_lengths:  # as ByteTokenizer's regex
            pieces.append(f"{uni[32]}{{{bt.run_lengths[0]},{bt.run_lengths[-1]}}}")
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[-1]))
        split = pre_tokenizers.Split(Regex("|".join([*pieces, "."])), "isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), split]
        )
    else:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        # no regex split: with no merges every byte is its own token whatever the words
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert [tok.token_to_id(t) for t in specials] == sorted(bt.SPECIAL)
    assert tok.get_vocab_size() == bt.vocab_size, (tok.get_vocab_size(), bt.vocab_size)
    return tok.to_str(pretty=True) + "\n"


def hf_tokenizer_config(bt: ByteTokenizer) -> dict:
    """tokenizer_config.json: transformers' fast tokenizer over tokenizer.json, and our marker."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        MARKER: BYTE_TOKENIZER,
        "bos_token": bt.SPECIAL[bt.bos_id],
        "eos_token": bt.SPECIAL[bt.eos_id],
        "pad_token": bt.SPECIAL[bt.pad_id],
        "split_special_tokens": True,  # "<eos>" in a text is its 5 bytes, as ByteTokenizer has it
        "clean_up_tokenization_spaces": False,
    }
    if bt.space_runs:
        cfg[RUNS_KEY] = bt.space_runs
    if bt.chat_tags:
        cfg[TAGS_KEY] = True
    if bt.space_unit:
        cfg[UNIT_KEY] = bt.space_unit
    return cfg


def write_tokenizer_files(model_dir: str | Path, tok: ByteTokenizer | None = None) -> None:
    """tok's files in model_dir (default: bytes): tokenizer.json and tokenizer_config.json, each
    replaced atomically, tokenizer.json first (a reader never finds a new config alone)."""
    d = Path(model_dir)
    for name, text in (tok or ByteTokenizer()).hf_files().items():
        tmp = d / f".{name}.tmp{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, d / name)
