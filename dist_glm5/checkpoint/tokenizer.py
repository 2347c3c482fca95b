"""Tokenizers: the byte-level one of the embedded model, or a checkpoint's tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

BYTE_TOKENIZER = "DistGlm5ByteTokenizer"


class ByteTokenizer:
    """ids 0..255 are bytes; then <bos>, <eos>, <pad>. Needs no download."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    SPECIAL = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

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


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, or None when it ships none (then only token ids work)."""
    d = Path(model_dir)
    tc = d / "tokenizer_config.json"
    if tc.exists() and json.loads(tc.read_text()).get("tokenizer_class") == BYTE_TOKENIZER:
        return ByteTokenizer()
    if (d / "tokenizer.json").exists():
        return HFTokenizer(d / "tokenizer.json")
    return None
