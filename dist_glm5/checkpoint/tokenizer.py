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
from pathlib import Path

BYTE_TOKENIZER = "DistGlm5ByteTokenizer"
MARKER = "dist_glm5_tokenizer"  # the tokenizer_config.json key naming ours (for our loader)


ENCODE_PIECE = 1 << 18  # bytes listed per call: a 4 MB prompt would hold the GIL ~100 ms at once


class ByteTokenizer:
    """ids 0..255 are bytes; then <bos>, <eos>, <pad>. Needs no download."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        if len(data) <= ENCODE_PIECE:
            return list(data)
        out: list[int] = []
        for i in range(0, len(data), ENCODE_PIECE):  # pieces: another thread gets the GIL between
            out += data[i : i + ENCODE_PIECE]
        return out

    SPECIAL = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes, in id order (what a grammar engine indexes: sampling/grammar.py)."""
        return [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>", b"<pad>"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", errors="replace"), self.SPECIAL.get(i, "")]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


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
        if BYTE_TOKENIZER in (cfg.get(MARKER), cfg.get("tokenizer_class")):  # the latter: old dirs
            return ByteTokenizer()
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


def hf_tokenizer_json() -> str:
    """tokenizer.json (Hugging Face tokenizers) equal to ByteTokenizer: ids and text alike."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    bt = ByteTokenizer()
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: with no merges every byte is its own token whatever the words
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [bt.SPECIAL[i] for i in sorted(bt.SPECIAL)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert [tok.token_to_id(t) for t in specials] == sorted(bt.SPECIAL)
    assert tok.get_vocab_size() == bt.vocab_size
    return tok.to_str(pretty=True) + "\n"


def hf_tokenizer_config() -> dict:
    """tokenizer_config.json: transformers' fast tokenizer over tokenizer.json, and our marker."""
    bt = ByteTokenizer()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        MARKER: BYTE_TOKENIZER,
        "bos_token": bt.SPECIAL[bt.bos_id],
        "eos_token": bt.SPECIAL[bt.eos_id],
        "pad_token": bt.SPECIAL[bt.pad_id],
        "split_special_tokens": True,  # "<eos>" in a text is its 5 bytes, as ByteTokenizer has it
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer_files(model_dir: str | Path) -> None:
    """The byte tokenizer's files in model_dir: tokenizer.json and tokenizer_config.json (each
    replaced atomically; tokenizer.json first, so a reader never finds the new config alone)."""
    d = Path(model_dir)
    files = {
        "tokenizer.json": hf_tokenizer_json(),
        "tokenizer_config.json": json.dumps(hf_tokenizer_config(), indent=2) + "\n",
    }
    for name, text in files.items():
        tmp = d / f".{name}.tmp{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, d / name)
