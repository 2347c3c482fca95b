"""Incremental detokenization: each step's text delta from a growing list of token ids, decoding a
few tokens per step instead of the whole output (vLLM's detokenize_incrementally).

Two offsets into the ids: `prefix` (where the decoded window starts: already-emitted tokens kept as
context, so a tokenizer that treats a leading piece specially decodes the new ones in place) and
`read` (the first token not yet emitted). A step decodes ids[prefix:read] and ids[prefix:]; the
new text is what the second adds. While it ends in U+FFFD (a multi-byte UTF-8 character split
across tokens) nothing is emitted: the next token completes it. `finish()` flushes the rest, so
the deltas concatenate to tokenizer.decode(ids) exactly.

Stop strings (`StopStrings`) are searched only where a new delta can complete one (the last
len(longest) - 1 characters before it, and the delta), and the same number of trailing characters
is held back from streaming until the end, so a client never sees the start of a stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stops: tuple[str, ...] = (), **decode_kw):
        """stops: the request's stop strings, matched by `self.stops` (built once per request,
        not per step); decode_kw: passed to tokenizer.decode (e.g. skip_special_tokens)."""
        self.tok, self.kw = tokenizer, decode_kw
        self.stops = StopStrings(stops) if stops else None
        self.prefix = 0  # start of the decoded window (context already emitted)
        self.read = 0  # first id whose text is not yet emitted

    def step(self, ids: list[int]) -> str:
        """The text the ids added since the last call ("" while a character is incomplete)."""
        if self.read >= len(ids):
            return ""
        before = self.tok.decode(ids[self.prefix : self.read], **self.kw)
        now = self.tok.decode(ids[self.prefix :], **self.kw)
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(ids)
            return now[len(before) :]
        return ""

    def finish(self, ids: list[int]) -> str:
        """Everything not yet emitted, an incomplete trailing character included (as U+FFFD)."""
        if self.read >= len(ids):
            return ""
        before = self.tok.decode(ids[self.prefix : self.read], **self.kw)
        now = self.tok.decode(ids[self.prefix :], **self.kw)
        self.prefix, self.read = self.read, len(ids)
        return now[len(before) :]


class StopStrings:
    """Finds the first stop string in text that grows by deltas, looking only where a new delta
    can complete one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, new_from: int) -> int | None:
        """Where the first stop string starts in `text`, given that text[:new_from] held none."""
        span = self.span(text, new_from)
        return span[0] if span else None

    def span(self, text: str, new_from: int) -> tuple[int, int] | None:
        """(start, end) of the first stop string in `text` (the longest, of those starting
        there), given that text[:new_from] held none."""
        start = max(0, new_from - self.hold)
        hits = [(i, -len(s)) for s in self.stops if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        i, neg = min(hits)
        return i, i - neg
