"""The trained default model's corpus: text every machine has, plus synthetic needle documents.

Text: the Python standard library shipped with the interpreter (its `.py` sources, docstrings and
comments included, and `pydoc_data/topics.py`, the language and library reference topics that
`help()` prints). Licence: Python Software Foundation License Version 2 (PSF-2.0), which permits
use, copying and derived works provided the PSF copyright notice is retained; the trained weights
are a derived work and the shipped held-out slice carries the notice (`heldout.json`).

Split: a file is held out when crc32 of its path relative to the stdlib is 0 mod 20 (about 5% of
the files), so the split does not depend on the order of the walk. The stdlib differs between
Python versions, so the figures a test checks use the slice frozen in `heldout.json`, not the
local stdlib.

Needles: a key and a value hidden in filler, asked for at the end with the same prefix, so that
answering is copying what followed the earlier occurrence of the prefix:
    ... filler [key 4821: q7x2m9] filler ... [key 4821: q7x2m9]
Needle.query ends after "[key 4821: " (the CI needle test asks so; the answer is "q7x2m9").
`bench quality` asks "[key 4821:" and takes " q7x2m9": with a BPE vocabulary a question ending in
the space would split the piece (" q") the training rows hold whole.
"""

from __future__ import annotations

import functools
import json
import random
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

# the held-out slice ships with the model it measures (package data of default_model)
HELDOUT_PATH = Path(__file__).resolve().parents[1] / "checkpoint/default_model/heldout.json"
PSF_NOTICE = (
    "Copyright (c) 2001 Python Software Foundation; All Rights Reserved. Text from the Python "
    "standard library, used under the PSF License Version 2."
)
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
VALUE_CHARS = "abcdefghijkmnpqrstuvwxyz23456789"
PROSE = (
    b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
_PROSE_POOL = [
    b"The grass is green.",
    b"The sky is blue.",
    b"The sun is yellow.",
    b"Here we go.",
    b"There and back again.",
    b"The river runs to the sea.",
    b"A cat sleeps on the warm wall.",
    b"Snow falls in the quiet night.",
    b"The train left on time.",
    b"Bread is baked every morning.",
    b"The wind turns the old mill.",
    b"Stars come out after dusk.",
]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every source file of the corpus, sorted."""
    root = stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        out.append((rel.as_posix(), p))
    return sorted(out)


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 20 == 0


def load_split(split: str) -> list[tuple[str, bytes]]:
    """[(relative path, bytes)] of the 'train' or 'heldout' split of the local stdlib."""
    want = split == "heldout"
    return [(rel, p.read_bytes()) for rel, p in stdlib_files() if is_heldout(rel) == want]


def reindent(data: bytes, step: int = 4, cap: int = 16) -> bytes:
    """data with every line's leading spaces made what a column count up to `cap` can follow:
    a multiple of `step` (rounded down), at most one step deeper than the last non-blank line,
    at most `cap`; a line of spaces only becomes empty. The rest of each line is unchanged.

    Why: greedy code from the stdlib-trained model wrote 96 spaces. In the raw stdlib, after 16
    leading spaces the next byte is a space 78% of the time pooled over positions (aligned
    continuation lines run to 40 and more), and the model's column head counts 16 bytes at most:
    past 16 it cannot tell where a run ends, so a space stays its argmax forever."""
    out, prev = [], 0
    for line in data.split(b"\n"):
        body = line.lstrip(b" ")
        if not body:
            out.append(b"")
            continue
        k = len(line) - len(body)
        prev = min(k - k % step, prev + step, cap)
        out.append(b" " * prev + body)
    return b"\n".join(out)


def squeeze_inner_spaces(data: bytes, cap: int = 2) -> bytes:
    """data with every run of spaces inside a line (after a byte other than a space or a
    newline) cut to `cap` spaces; leading spaces are reindent's.

    Why: with the indentation re-indented (at most 16, 4-space steps), r1 still gave a 17th space
    0.5-0.7: the aligned tables and comments of the stdlib run inner spaces to 40 and more, and a
    window of 16 spaces does not say whether a newline is before them. With inner runs of at most
    `cap` (PEP 8's two before an inline comment), three spaces in a row are indentation and 16 are
    its deepest: nothing in the training code follows 16 spaces with a 17th."""
    return re.sub(rb"(?<=[^ \n]) {%d,}" % (cap + 1), b" " * cap, data)


def frozen_heldout() -> list[dict]:
    """The held-out texts frozen at training time: [{'path', 'text'}] (stdlib, PSF licence)."""
    return json.loads(HELDOUT_PATH.read_text())["texts"]


def write_frozen_heldout(n_texts: int = 8, n_bytes: int = 4096, seed: int = 0) -> None:
    """Freeze n_texts slices of the held-out split (the tests and the bench read these)."""
    import platform

    rng = random.Random(seed)
    files = [(r, b) for r, b in load_split("heldout") if len(b) > 2 * n_bytes]
    texts = []
    for rel, data in rng.sample(files, n_texts):
        start = rng.randrange(0, len(data) - n_bytes)
        chunk = data[start : start + n_bytes].decode("utf-8", errors="ignore")
        texts.append({"path": rel, "offset": start, "text": chunk})
    doc = {
        "source": f"Python {platform.python_version()} standard library, held-out split",
        "licence": "PSF-2.0",
        "notice": PSF_NOTICE,
        "texts": texts,
    }
    HELDOUT_PATH.write_text(json.dumps(doc, indent=1) + "\n")


# ---- needle documents ------------------------------------------------------------------------
@dataclass
class Needle:
    key: str
    value: str

    @property
    def line(self) -> bytes:
        return f"[key {self.key}: {self.value}]".encode()

    @property
    def query(self) -> bytes:
        return f"[key {self.key}: ".encode()


def make_needles(rng: random.Random, n: int) -> list[Needle]:
    keys = rng.sample(range(1000, 10000), n)
    return [Needle(str(k), "".join(rng.choice(VALUE_CHARS) for _ in range(6))) for k in keys]


def prose_filler(rng: random.Random, n_bytes: int, classic: bool = False) -> bytes:
    """Repetitive prose: the classic pass-key filler, or sentences drawn from a small pool."""
    if classic:
        reps = n_bytes // len(PROSE) + 1
        return (PROSE * reps)[:n_bytes]
    out, size = [], 0
    while size < n_bytes:
        s = rng.choice(_PROSE_POOL) + b" "
        out.append(s)
        size += len(s)
    return b"".join(out)[:n_bytes]


def _cut_at_line(filler: bytes, pos: int) -> int:
    """A position at a line (code) or sentence (prose) boundary near pos."""
    for sep in (b"\n", b". "):
        j = filler.rfind(sep, max(0, pos - 200), pos)
        if j >= 0:
            return j + len(sep)
    return pos


def needle_prompt(
    rng: random.Random, filler: bytes, needles: list[Needle], depth: tuple[float, float] = (0, 1)
) -> bytes:
    """filler with each needle inserted at a random depth (fraction of the filler)."""
    cuts = sorted(
        _cut_at_line(filler, int(len(filler) * rng.uniform(*depth))) for _ in range(len(needles))
    )
    parts, prev = [], 0
    for c, nd in zip(cuts, needles):
        parts += [filler[prev:c], b"\n" + nd.line + b"\n"]
        prev = c
    parts.append(filler[prev:])
    return b"".join(parts)


class Doc:
    """A training document and, for every byte, the earlier position it repeats (-1: none).

    The source map is what the trainer's attention supervision reads: a byte t that repeats the
    byte at src[t] should be followed by what followed src[t] (induction)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.src: list[int] = []

    def add(self, b: bytes, src: int = -1) -> int:
        """Append b (a repeat of the bytes at src.. when src >= 0); returns where it starts."""
        at = len(self.data)
        self.data += b
        self.src += [src + i if src >= 0 else -1 for i in range(len(b))]
        return at


def decoy_needles(rng: random.Random, needles: list[Needle], n: int) -> list[Needle]:
    """n needles of other keys whose values begin as one of needles' does (1..4 characters) and
    then differ: an answer copied past its first pieces must follow its own needle, as it must
    in code, where a value's first pieces start many names (v6 copied ` sc` of ` sc5kzp` at 16K
    bytes of code and then followed another ` sc`)."""
    taken = {nd.key for nd in needles}
    keys = rng.sample([k for k in range(1000, 10000) if str(k) not in taken], n)
    out = []
    for key in keys:
        v = rng.choice(needles).value
        k = rng.randint(1, min(4, len(v) - 1))
        nxt = rng.choice([c for c in VALUE_CHARS if c != v[k]])
        rest = "".join(rng.choice(VALUE_CHARS) for _ in range(len(v) - k - 1))
        out.append(Needle(str(key), v[:k] + nxt + rest))
    return out


def needle_training_doc(
    rng: random.Random, filler: bytes, n_needles: int = 3, decoys: int = 0
) -> tuple[bytes, list[int]]:
    """A training document: needles in filler, then every needle asked and answered (random
    order), len(filler) bytes in all. The answers repeat their needle from the key on (the shared
    "[key " prefix is not a repeat of any one needle). decoys: that many more needles, never
    asked, whose values share a first part with an asked one's (decoy_needles)."""
    asked = make_needles(rng, n_needles)
    needles = asked[:]
    if decoys:  # (without, the draws are the committed recipe's)
        needles += decoy_needles(rng, asked, decoys)
        rng.shuffle(needles)  # a decoy before or after its needle
    rng.shuffle(asked)
    # the needles and the answers fit in len(filler): the answers must not be cut off
    extra = sum(len(nd.line) + 2 for nd in needles) + sum(len(nd.line) + 1 for nd in asked) + 1
    body = filler[: max(0, len(filler) - extra)]
    cuts = sorted(_cut_at_line(body, int(len(body) * rng.uniform(0.0, 0.95))) for _ in needles)
    doc, at, prev = Doc(), {}, 0
    for c, nd in zip(cuts, needles):
        doc.add(body[prev:c] + b"\n")
        at[nd.key] = doc.add(nd.line)
        doc.add(b"\n")
        prev = c
    doc.add(body[prev:])
    skip = len(b"[key ")
    for nd in asked:
        doc.add(b"\n" + nd.line[:skip])
        doc.add(nd.line[skip:], at[nd.key] + skip)
    doc.add(b"\n")
    return bytes(doc.data), doc.src


def copy_training_doc(rng: random.Random, text: bytes, n_copies: int) -> tuple[bytes, list[int]]:
    """text with n_copies spans of it repeated later in it (24..160 bytes each): the cheapest
    data that teaches a small model to copy (induction), which needle retrieval is made of."""
    out = bytearray(text)
    src = [-1] * len(out)
    n = len(out)
    for _ in range(n_copies):
        size = rng.randint(24, min(160, n // 4))
        a = rng.randrange(0, n // 2 - size)
        dst = rng.randrange(a + size + 8, n - size)
        out[dst : dst + size] = out[a : a + size]
        src[dst : dst + size] = range(a, a + size)
    return bytes(out), src


REPEAT_UNITS = tuple(c.encode() for c in VALUE_CHARS + "ABCDEFGHJKLMNPQRSTUVWXYZ_-")


def repeat_training_doc(
    rng: random.Random, code: bytes, n: int, pieces: tuple[bytes, ...] = ()
) -> tuple[bytes, list[int]]:
    """Random strings (8..48 bytes) each said 2..4 times with a little code between: nothing but
    copying predicts their repeats, so this is where a small model learns to copy. With pieces
    (a BPE vocabulary's word pieces, copy_pieces) a string is random pieces and characters, so
    that merged pieces are copied too: random characters rarely merge, and BPE models copied
    single characters at 0.9+ but merged letter pieces (`if`, `ut`) at 0.01-0.16 (v3, v4)."""
    units = REPEAT_UNITS + pieces
    doc = Doc()
    while len(doc.data) < n:
        size, s = rng.randint(8, 48), b""
        while len(s) < size:
            s += rng.choice(units)
        first = -1
        for _ in range(rng.randint(2, 4)):
            at = doc.add(s, first)
            first = at if first < 0 else first
            a = rng.randrange(0, max(1, len(code) - 64))
            doc.add(b" " + code[a : a + rng.randint(0, 64)] + b"\n")
    return bytes(doc.data), doc.src


def copy_pieces(merged: list[bytes]) -> tuple[bytes, ...]:
    """The merged pieces a random value may hold: letters, digits and underscores only."""
    return tuple(p for p in merged if re.fullmatch(rb"[A-Za-z0-9_]+", p))


@functools.lru_cache(maxsize=4)
def bpe(vocab_size: int):
    """The BPE vocabulary of vocab_size ids (checkpoint/bpe.py) learnt on the training split's
    code as it is on disk: the same for every run's corpus flags, and for a resume."""
    from dist_glm5.checkpoint.bpe import BpeTokenizer, train_merges
    from dist_glm5.checkpoint.tokenizer import CHAT_TAGS, FIRST_RUN_ID

    first = FIRST_RUN_ID + len(CHAT_TAGS)
    if vocab_size <= first:
        raise ValueError(f"a BPE vocabulary needs more than {first} ids (bytes, specials, tags)")
    text = b"\n".join(b for _, b in load_split("train"))
    return BpeTokenizer(train_merges(text, vocab_size - first))
