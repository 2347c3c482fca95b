"""Per-request sampling parameters (no torch: the control plane imports this).

Validated on construction: a bad value names the field and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dist_glm5.sampling.grammar import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences never to produce
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # likewise for every prompt token after the first
    ignore_eos: bool = False
    # as vLLM: frequency/presence over the output's tokens, repetition over prompt and output
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: GrammarSpec | None = None  # structured output: the last stage masks by it
    # special tokens in the text (the ids are always returned); None: the tokenizer's default
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) in the text

    def __post_init__(self) -> None:
        # types first: a value of the wrong type must never reach the engine's math
        for name, holds, why in _TYPES:
            if not holds(getattr(self, name)):
                raise self._bad(name, why)
        for name in _FLOATS:
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.grammar is not None and self.ignore_eos:
            raise self._bad("ignore_eos", "cannot be combined with a grammar (it ends with EOS)")
        for name, holds, why in _RANGES:
            if not holds(getattr(self, name)):
                raise self._bad(name, why)
        self._normalise_stops()
        self._normalise_bad_words()
        self._normalise_logit_bias()

    def _bad(self, name: str, why: str) -> ValueError:
        v = repr(getattr(self, name))
        return ValueError(f"{name}={v if len(v) <= 60 else v[:57] + '...'} {why}")

    def _normalise_stops(self) -> None:
        object.__setattr__(self, "stop_token_ids", _ints(self.stop_token_ids, "stop_token_ids"))
        if isinstance(self.stop, str) or not _is_seq(self.stop):
            raise self._bad("stop", "must be a list of strings")
        if not all(isinstance(x, str) and x for x in self.stop):
            raise self._bad("stop", "must hold non-empty strings only")
        object.__setattr__(self, "stop", tuple(self.stop))

    def _normalise_bad_words(self) -> None:
        if not _is_seq(self.bad_words) or not all(_is_seq(w) for w in self.bad_words):
            raise self._bad("bad_words", "must be a list of token-id lists")
        words = tuple(_ints(w, "bad_words") for w in self.bad_words)
        if any(len(w) == 0 for w in words):
            raise self._bad("bad_words", "must not contain an empty word")
        object.__setattr__(self, "bad_words", words)

    def _normalise_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise self._bad("logit_bias", "must map token ids to numbers")
        bias = {}
        for k, v in self.logit_bias.items():
            tok = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
            if not _is_int(tok) or not _is_finite(v):
                raise ValueError(
                    f"logit_bias entry {k!r}: {v!r} must map a token id to a finite number"
                )
            bias[int(tok)] = float(v)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty) or (
            self.repetition_penalty != 1.0
        )


def check_vocab(p: SamplingParams, vocab: int) -> None:
    ids = [*p.stop_token_ids, *p.logit_bias, *(t for w in p.bad_words for t in w)]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} in the sampling parameters are outside the vocabulary "
            f"0..{vocab - 1}"
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _is_seq(v) -> bool:
    return isinstance(v, (list, tuple))


def _ints(v, name: str) -> tuple[int, ...]:
    if not _is_seq(v) or not all(_is_int(t) for t in v):
        raise ValueError(f"{name}={v!r} must be a list of integer token ids")
    return tuple(v)


def _optional(holds):
    return lambda v: v is None or holds(v)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
# (field, holds, why), checked in this order: the first failure is the one reported
_TYPES = (
    *((name, _is_finite, "must be a finite number") for name in _FLOATS),
    *((name, _is_int, "must be an integer") for name in ("top_k", "max_tokens", "min_tokens")),
    *(
        (name, _optional(_is_int), "must be an integer or null")
        for name in ("seed", "logprobs", "prompt_logprobs")
    ),
    ("ignore_eos", _is_bool, "must be true or false"),
    ("skip_special_tokens", _optional(_is_bool), "must be true or false"),
    ("include_stop_str_in_output", _is_bool, "must be true or false"),
    ("grammar", _optional(lambda v: isinstance(v, GrammarSpec)), "must be a GrammarSpec"),
)
# after the types (the floats are floats by then), before the lists
_RANGES = (
    ("temperature", lambda v: v >= 0, "must be >= 0 (0 means greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: v >= 0, "must be >= 0 (0 turns it off)"),
    ("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
    ("repetition_penalty", lambda v: v > 0, "must be > 0 (1 turns it off)"),
    ("max_tokens", lambda v: v >= 0, "must be >= 0"),
    ("min_tokens", lambda v: v >= 0, "must be >= 0"),
    ("seed", _optional(lambda v: -(1 << 63) <= v < (1 << 64)), "must be in [-2**63, 2**64)"),
    ("logprobs", _optional(lambda v: 0 <= v <= 20), "must be between 0 and 20"),
    ("prompt_logprobs", _optional(lambda v: 0 <= v <= 20), "must be between 0 and 20"),
)
