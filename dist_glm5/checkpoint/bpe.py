"""A byte-level BPE vocabulary for the trained default model, trained on its own corpus.

Why: a byte model at the 3-hour budget sees about 6 MB of text (docs/trained_default.md); with
pieces of about 2.7 bytes of code per id the same steps see about 2.5x the text, and a needle
16K bytes back is about 6K ids back. `tokenizers` would train such a vocabulary too, but it
takes str (a window cut inside a UTF-8 character is not one), so merges are learnt here on bytes
and tokenizers reads the result (tokenizer.json, `hf_tokenizer_json`): tests check the two agree.

Ids: 0..255 the bytes and 256..258 <bos> <eos> <pad>, as ByteTokenizer's; then one id per chat
tag (always: GLM's tokenizer has them as single ids); then the merged pieces in the order learnt.
A text is cut into tags first, then into pieces by PIECES (a word with the space before it,
up to 3 digits, a run of punctuation, newlines, 4 spaces of indentation, other blanks), and
each piece is merged by rank as GPT-2's BPE does.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter

from .tokenizer import (
    BPE_TOKENIZER,
    CHAT_TAGS,
    FIRST_RUN_ID,
    MARKER,
    ByteTokenizer,
    _bytes_to_unicode,
)

_WS = " \t\n\r\x0b\x0c"  # what the pieces treat as blanks


def _pattern(ch) -> str:
    """PIECES with every blank written by ch(byte) (itself in bytes, its byte-level char in
    tokenizer.json, whose split runs after the byte-level mapping)."""
    sp, ws = ch(32), "".join(ch(ord(c)) for c in _WS)
    nl = ch(10) + ch(13)
    other_ws = ch(32) + ch(9) + ch(11) + ch(12)
    return "|".join(
        [
            f"{sp}?[A-Za-z_]+",  # a name, with the space before it
            f"{sp}?[0-9]{{1,3}}",
            f"{sp}?[^{ws}A-Za-z0-9_]+",  # a run of punctuation (and of non-ASCII bytes)
            f"[{nl}]+",
            f"{sp}{{4}}",  # an indentation step
            f"[{other_ws}]+",
        ]
    )


PIECES = re.compile(_pattern(lambda b: re.escape(chr(b))).encode("latin-1"))
_TAGS = re.compile(b"|".join(re.escape(t.encode()) for t in CHAT_TAGS))


def pieces(data: bytes) -> list[bytes]:
    """data (no tags) cut into the pieces merges act within; they cover every byte."""
    return [m.group(0) for m in PIECES.finditer(data)]


def merge_pair(s: list[bytes], p: tuple[bytes, bytes]) -> list[bytes]:
    """s with every occurrence of the pair p merged, left to right."""
    out, j = [], 0
    while j < len(s):
        if j + 1 < len(s) and (s[j], s[j + 1]) == p:
            out.append(p[0] + p[1])
            j += 2
        else:
            out.append(s[j])
            j += 1
    return out


def train_merges(data: bytes, n_tokens: int) -> list[tuple[bytes, bytes]]:
    """BPE merges learnt on data's pieces until they make n_tokens new tokens: each step merges
    the most frequent adjacent pair (ties: the smaller bytes first, so a run is reproducible).
    A merge whose bytes are a token already is kept (the rank order needs it) but adds none."""
    words = Counter(pieces(data))
    seqs = [[bytes([b]) for b in w] for w in words]
    freq = list(words.values())
    pair_n: Counter = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = {}
    for i, s in enumerate(seqs):
        for p in zip(s, s[1:], strict=False):
            pair_n[p] += freq[i]
            where.setdefault(p, set()).add(i)
    heap = [(-n, p) for p, n in pair_n.items()]
    heapq.heapify(heap)
    merges, made = [], set()
    while len(made) < n_tokens and heap:
        n, p = heapq.heappop(heap)
        if -n != pair_n.get(p, 0) or n == 0:
            continue  # a stale count: the pair's current one is in the heap too
        merges.append(p)
        made.add(p[0] + p[1])
        touched = set()
        for i in where.pop(p, ()):
            s, f = seqs[i], freq[i]
            for q in zip(s, s[1:], strict=False):
                pair_n[q] -= f
                touched.add(q)
            seqs[i] = out = merge_pair(s, p)
            for q in zip(out, out[1:], strict=False):
                pair_n[q] += f
                touched.add(q)
                where.setdefault(q, set()).add(i)
        pair_n.pop(p, None)
        for q in touched:
            if pair_n.get(q, 0) > 0:
                heapq.heappush(heap, (-pair_n[q], q))
    return merges


class BpeTokenizer(ByteTokenizer):
    """ByteTokenizer's ids (bytes, specials, chat tags) and merged pieces after them."""

    def __init__(self, merges: list[tuple[bytes, bytes]]) -> None:
        self.merge_list = [(bytes(a), bytes(b)) for a, b in merges]
        self.merged = list(dict.fromkeys(a + b for a, b in self.merge_list))  # new ids' bytes
        super().__init__(chat_tags=True)
        self.rank = {p: r for r, p in enumerate(self.merge_list)}
        self.first_merged_id = FIRST_RUN_ID + len(self.tags)
        self._piece_id = {t: self.first_merged_id + i for i, t in enumerate(self.merged)}
        self._piece_id.update({bytes([b]): b for b in range(256)})
        self.vocab_size = self.first_merged_id + len(self.merged)
        self._bytes = self.token_bytes()
        self._cache: dict[bytes, list[int]] = {}

    @property
    def space_ids(self) -> bool:
        return True  # an id may hold several spaces (the column losses count bytes: off)

    @property
    def merges(self) -> bool:
        return True

    def hf_files(self) -> dict[str, str]:
        cfg = json.dumps(hf_tokenizer_config(self), indent=2) + "\n"
        return {"tokenizer.json": hf_tokenizer_json(self), "tokenizer_config.json": cfg}

    def token_bytes(self) -> list[bytes]:
        return super().token_bytes() + self.merged

    def _piece(self, w: bytes) -> list[int]:
        """One piece's ids: its pairs merged lowest rank first, every occurrence left to right."""
        got = self._cache.get(w)
        if got is not None:
            return got
        s = [bytes([b]) for b in w]
        while len(s) > 1:
            ranks = [self.rank.get(p) for p in zip(s, s[1:], strict=False)]
            best = min((r for r in ranks if r is not None), default=None)
            if best is None:
                break
            s = merge_pair(s, self.merge_list[best])
        ids = [self._piece_id[t] for t in s]
        if len(self._cache) < 1 << 20:
            self._cache[w] = ids
        return ids

    def encode_bytes(self, data: bytes) -> list[int]:
        return self.merge(list(data))[0]

    def merge(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """ids (bytes, special ids among them) -> (this vocabulary's ids, where each starts in
        ids): tags are one id each, the bytes between are cut into pieces and merged."""
        out, starts, i, n = [], [], 0, len(ids)
        while i < n:
            if ids[i] >= 256:
                out.append(ids[i])
                starts.append(i)
                i += 1
                continue
            j = i
            while j < n and ids[j] < 256:
                j += 1
            seg, at = bytes(ids[i:j]), 0
            for m in [*_TAGS.finditer(seg), None]:
                end = m.start() if m else len(seg)
                for w in PIECES.finditer(seg, at, end):
                    k = w.start()
                    for t in self._piece(w.group(0)):
                        out.append(t)
                        starts.append(i + k)
                        k += len(self._bytes[t])
                if m:
                    out.append(self.tag_id(m.group(0).decode()))
                    starts.append(i + m.start())
                    at = m.end()
            i = j
        return out, starts


def hf_tokenizer_json(tok: BpeTokenizer) -> str:
    """tokenizer.json (Hugging Face tokenizers) equal to tok: ids and text alike."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    uni = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(uni[x] for x in b)

    vocab = {uni[b]: b for b in range(256)}
    vocab.update({s(t): i for t, i in tok._piece_id.items() if i >= tok.first_merged_id})
    # the specials and tags hold their ids in the model's vocabulary too (tokenizers numbers
    # added tokens from the vocabulary's size on); no piece is one (a piece never holds `<` and
    # letters both)
    vocab.update({name: i for i, name in tok.SPECIAL.items()})
    vocab.update({x: tok.tag_id(x) for x in tok.tags})
    merges = [(s(a), s(b)) for a, b in tok.merge_list]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    split = _pattern(lambda b: re.escape(uni[b]))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex(split), "isolated"),
        ]
    )
    t.decoder = decoders.ByteLevel()
    data = json.loads(t.to_str())
    added = [(i, name, True) for i, name in sorted(tok.SPECIAL.items())]
    added += [(tok.tag_id(x), x, False) for x in tok.tags]
    data["added_tokens"] = [
        {
            "id": i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, name, special in added
    ]
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    check = Tokenizer.from_str(text)
    assert check.get_vocab_size() == tok.vocab_size, (check.get_vocab_size(), tok.vocab_size)
    assert [check.token_to_id(n) for _, n, _ in added] == [i for i, _, _ in added]
    return text


def hf_tokenizer_config(tok: BpeTokenizer) -> dict:
    """tokenizer_config.json: transformers' fast tokenizer over tokenizer.json, and our marker."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        MARKER: BPE_TOKENIZER,
        "bos_token": tok.SPECIAL[tok.bos_id],
        "eos_token": tok.SPECIAL[tok.eos_id],
        "pad_token": tok.SPECIAL[tok.pad_id],
        "split_special_tokens": True,  # "<eos>" in a text is its bytes, as ours has it
        "clean_up_tokenization_spaces": False,
    }


def from_tokenizer_json(text: str) -> BpeTokenizer:
    """The BpeTokenizer a tokenizer.json of hf_tokenizer_json holds (its merges, in rank order)."""
    uni = {c: b for b, c in _bytes_to_unicode().items()}
    merges = json.loads(text)["model"]["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    return BpeTokenizer([(bytes(uni[c] for c in a), bytes(uni[c] for c in b)) for a, b in pairs])
