"""Structured output: a grammar per request, applied as a token mask before sampling.

The grammar engine is llguidance (Microsoft's, the one vLLM and SGLang also ship; chosen over
xgrammar because it installs as one small wheel on CPU, with no triton, and has what MTP needs:
`rollback` and `try_consume_tokens`). This module adds only what it lacks: our tokenizers as its
tokenizers, GLM's tool-call format as a grammar, and the mask as a boolean tensor over the model's
vocabulary (which may be larger than the tokenizer's).

`GrammarSpec` is plain data (no torch, no llguidance): requests carry it through the control
plane; the last stage compiles it once per request into a `GrammarMatcher`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field, fields

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "lark", "tool_calls")
# Compact JSON (no free whitespace between tokens): whitespace the grammar allows anywhere is
# what a weak model loops on.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser limits (its `LLParserLimits`, same names and defaults) plus how far the
    edge walks a grammar before accepting it. Carried inside each GrammarSpec, so the last stage
    compiles a grammar under exactly the limits the server checked it with. Each is set by the
    environment variable DIST_GLM5_GRAMMAR_<NAME> (read once per process, by the server)."""

    max_items_in_row: int = 2000  # Earley items per row (branching of one production)
    initial_lexer_fuel: int = 1_000_000  # building the lexer's regexes (~50k/ms)
    step_lexer_fuel: int = 200_000  # lexer work per token mask (~14k/ms)
    step_max_items: int = 50_000  # Earley items per token mask (~20k/ms)
    max_lexer_states: int = 250_000  # lexer DFA states (1-2 kB each)
    max_grammar_size: int = 500_000  # symbols in the grammar's productions
    check_tokens: int = 32  # the edge's probe walk: tokens consumed after the first mask

    @classmethod
    def from_env(cls, environ=None) -> GrammarLimits:
        environ = os.environ if environ is None else environ
        kw = {}
        for f in fields(cls):
            name = f"DIST_GLM5_GRAMMAR_{f.name.upper()}"
            if (v := environ.get(name)) is None:
                continue
            if not v.strip().isdigit():
                raise ValueError(f"{name}={v!r}: give a whole number >= 0")
            kw[f.name] = int(v)
        return cls(**kw)

    def ll(self):
        """llguidance's LLParserLimits. verbose_errors off: its errors would otherwise carry the
        parser state and our internal grammar to the client."""
        import llguidance

        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "check_tokens"}
        return llguidance.LLParserLimits(**kw, precompute_large_lexemes=True, verbose_errors=False)


@functools.cache
def default_limits() -> GrammarLimits:
    return GrammarLimits.from_env()


class GrammarError(ValueError):
    """A grammar the edge refuses. why: "invalid", "too_large" or "unsatisfiable"."""

    def __init__(self, why: str, message: str):
        super().__init__(message)
        self.why = why


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    # json_schema: the schema as JSON text; regex / lark: the grammar; tool_calls: a JSON list
    # of {"name", "parameters"} of the functions a call may name
    text: str = ""
    min_calls: int = 1  # tool_calls: at least this many calls
    max_calls: int = 0  # tool_calls: at most this many (0: no limit)
    limits: GrammarLimits = field(default_factory=default_limits)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind {self.kind!r}: use one of {', '.join(KINDS)}")

    # The schema's text keeps its key order: llguidance writes an object's properties in the
    # order the schema lists them (OpenAI's structured outputs do too), and GLM's calls their
    # arguments so (required first). Sorted keys had served {"name", "city"} as city first.
    @staticmethod
    def json_schema(schema: dict) -> GrammarSpec:
        try:
            return GrammarSpec("json_schema", json.dumps(schema))
        except RecursionError:
            raise GrammarError("invalid", "the JSON schema is nested too deeply") from None

    @staticmethod
    def tool_calls(functions: list[dict], min_calls: int = 1, max_calls: int = 0) -> GrammarSpec:
        """functions: [{"name": ..., "parameters": JSON schema}] (OpenAI's `function` objects)."""
        fs = [{"name": f["name"], "parameters": f.get("parameters") or {}} for f in functions]
        try:
            text = json.dumps(fs)
        except RecursionError:
            raise GrammarError("invalid", "the tool parameters are nested too deeply") from None
        return GrammarSpec("tool_calls", text, min_calls, max_calls)


# ---- GLM tool calls as a Lark grammar -----------------------------------------------------------
# Values of string properties are raw text up to </arg_value> (GLM does not quote them), within the
# property's enum / const / minLength / maxLength / pattern; the others are JSON constrained by the
# property's own schema (%json). The properties come in the schema's order, each at most once, an
# optional one skippable where it stands (as llguidance does for a JSON object, and the trainer's
# corpus writes calls): any output is a call whose arguments validate.
_ANY = "(?s:.)"


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a Lark string literal is a JSON string literal


# A raw value holds none of the call's tags: our reader (launch/api/tool_calls.py) cuts it at the
# first closing one, and GLM's other readers (vLLM's regex over <arg_key>..</arg_value> pairs) would
# take `</arg_key><arg_value>` inside a value for a new argument.
_NO_TAG = "~/(?s:.)*<\\/?(arg_key|arg_value|tool_call)>(?s:.)*/"


def _raw_string_rule(name: str, schema: dict) -> str | None:
    """Lark rules for a string property written raw and closed by </arg_value>, or None if it
    is not a string. A lexeme that may contain '<' cannot be followed by a literal tag (the lexer
    is greedy), so the value and its tag are one lazy lexeme (a terminal: the value's pattern,
    its length and _NO_TAG intersected, then the tag); it ends at the first tag."""
    if schema.get("type") != "string":
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return f'{name}: ({" | ".join(_lark_str(str(v)) for v in values)}) "</arg_value>"'
    parts = [f"/{pattern_regex(schema['pattern'])}/"] if "pattern" in schema else []
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    if not parts or lo or hi is not None:
        parts.append(f"/{_ANY}{{{lo},{'' if hi is None else int(hi)}}}/")
    terminal = name.upper()
    return "\n".join(
        [
            f'{terminal}: ({" & ".join([*parts, _NO_TAG])}) "</arg_value>"',
            f"{name}[lazy]: {terminal}",
        ]
    )


def _top_level_alternatives(pattern: str) -> list[str]:
    """The pattern split at its top-level `|` (escapes, classes and groups respected); a
    ValueError if a group or class is left open or closed twice: such a pattern could otherwise
    reach outside the group it is embedded in."""
    alts, start, depth, i = [], 0, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i = _after_escape(pattern, i)
            continue
        if c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise ValueError("pattern has an unbalanced ')'")
        elif c == "|" and depth == 0:
            alts.append(pattern[start:i])
            start = i + 1
        i += 1
    if depth:
        raise ValueError("pattern has an unclosed group or class")
    return alts + [pattern[start:]]


def _after_escape(pattern: str, i: int) -> int:
    """The index after the escape that starts at pattern[i] (a backslash)."""
    if i + 1 == len(pattern):
        raise ValueError("pattern ends with a lone backslash")
    return i + 2


def _class_end(pattern: str, i: int) -> int:
    """The index of the `]` that closes the class opened at pattern[i]; a ValueError if none
    does."""
    # a `]` (or `^]`) right after the opening bracket is a literal
    j = i + 1 + (pattern[i + 1 : i + 2] == "^")
    if pattern[j : j + 1] == "]":
        i = j
    i += 1
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i = _after_escape(pattern, i)
            continue
        if c == "]":
            return i
        if c == "[" and pattern.startswith("[:", i):  # POSIX class inside a class
            end = pattern.find(":]", i + 2)
            i = end + 1 if end >= 0 else i
        i += 1
    raise ValueError("pattern has an unclosed group or class")


def pattern_regex(pattern: str) -> str:
    """A JSON-schema `pattern` as a regex for a whole value, safe inside Lark's /.../.

    JSON schema searches for a pattern (ECMA-262), so each top-level alternative is wrapped in
    `.*` where it is not anchored by a leading `^` / trailing `$` (llguidance has no anchors
    inside a regex; an anchor elsewhere stays and is refused by its compiler). `/` and newlines
    are escaped and \\d, \\w are ASCII, as in llguidance's own JSON-schema compiler
    (`regex_to_lark(p, "dw")`); each alternative sits in its own group, which the balance check
    above keeps it inside: a pattern can neither end the regex nor add a rule."""
    from llguidance import regex_to_lark

    if not isinstance(pattern, str):
        raise ValueError("pattern must be a string")
    out = []
    for alt in _top_level_alternatives(pattern):
        head = alt.startswith("^")
        escapes = len(alt[:-1]) - len(alt[:-1].rstrip("\\"))  # backslashes before a last `$`
        tail = alt.endswith("$") and escapes % 2 == 0 and len(alt) > int(head)
        core = alt[int(head) : len(alt) - int(tail)]
        out.append(f"{'' if head else _ANY + '*'}(?:{core}){'' if tail else _ANY + '*'}")
    return regex_to_lark("(?:" + "|".join(out) + ")", "dw")


def tool_call_lark(functions: list[dict], min_calls: int = 1, max_calls: int = 0) -> str:
    rules, alts = [], []
    for i, f in enumerate(functions):
        params = f.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, key in enumerate(props):
            try:
                raw = _raw_string_rule(f"val_{i}_{j}", props[key])
            except ValueError as e:
                raise GrammarError("invalid", f"property {key!r}: {e}") from None
            if raw is None:  # compact JSON, as for response_format (free whitespace loops)
                schema = {**props[key], "x-guidance": JSON_OPTIONS}
                value = f'%json {json.dumps(schema)} "</arg_value>"'
            else:
                value = f"val_{i}_{j}"
                rules.append(raw)
            rules.append(
                f"arg_{i}_{j}: {_lark_str(f'<arg_key>{key}</arg_key><arg_value>')} {value}"
            )
            parts.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        rules.append(f"fn_{i}: {_lark_str(f['name'])} {' '.join(parts)}".rstrip())
        alts.append(f"fn_{i}")
    if max_calls and max_calls < min_calls:
        raise ValueError(f"max_calls {max_calls} < min_calls {min_calls}")
    rep = f"{{{min_calls},{max_calls}}}" if max_calls else f"{{{min_calls},}}"
    return "\n".join(
        [
            f"start: call{rep}",
            f'call: "<tool_call>" ({" | ".join(alts)}) "</tool_call>"',
            *rules,
        ]
    )


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (a ValueError names what is wrong with it)."""
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
        return LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.text)
    fs = json.loads(spec.text)
    return LLMatcher.grammar_from_lark(tool_call_lark(fs, spec.min_calls, spec.max_calls))


# ---- the edge's check: compile as the last stage will, then walk a little ---------------------
_UNSATISFIABLE = ("NoExtension", "NoExtensionBias")
_TOO_LARGE = ("too many", "too big", "too large", "fuel", "limit", "TooComplex", "MaxTokens")


def public_error(err: str, kind: str) -> str:
    """llguidance's message without what is ours: the parser state, the excerpt of the grammar
    it compiled (for every kind but a client's own Lark it is our wrapping, and for tool calls
    our whole internal grammar), and the regexes quoted from it."""
    err = re.split(r"\n?<(?:state|non-verbose/)>", err, maxsplit=1)[0]
    lines = []
    for line in err.splitlines():
        if re.match(r"\s*\d+ \| ", line) or not line.strip(" ^"):
            continue  # a source excerpt and its caret
        if kind != "lark" and line[:1].isspace():
            continue  # an indented excerpt: the regex as we wrapped it
        lines.append(line.strip())
    out = " ".join(lines)
    if kind != "lark":
        out = re.sub(r"^at \d+\(\d+\): ", "", out)
        out = re.sub(r'invalid regex ".*?" \(in [^)]*\)', "invalid regex", out)
        out = re.sub(r" in regex /.*$", "", out)
    return out[:400] or "unknown error"


def _refusal(kind: str, err: str, stop_reason: str = "") -> GrammarError:
    text = public_error(err, kind)
    if stop_reason in _UNSATISFIABLE or err.startswith(_UNSATISFIABLE):  # stopped at once
        return GrammarError(
            "unsatisfiable", f"{kind} grammar cannot be satisfied (no output matches it)"
        )
    if "nsatisfiable" in err:  # llguidance's JSON compiler saw it (e.g. minimum > maximum)
        return GrammarError("unsatisfiable", f"{kind} grammar cannot be satisfied ({text})")
    if stop_reason in ("LexerTooComplex", "ParserTooComplex") or any(w in err for w in _TOO_LARGE):
        return GrammarError(
            "too_large", f"{kind} grammar is too large for this server's grammar limits ({text})"
        )
    return GrammarError("invalid", f"{kind} grammar does not compile: {text}")


def _compile(spec: GrammarSpec, ll_tok):
    """The llguidance matcher of a spec, exactly as the last stage builds it, or a GrammarError.
    Building it drops the GIL (llguidance's own note: 100-1000 ms for extreme grammars)."""
    import llguidance

    try:
        text = grammar_text(spec)
    except GrammarError:
        raise
    except ValueError as e:  # not JSON, or a schema llguidance cannot read at all
        raise GrammarError("invalid", public_error(str(e), spec.kind)) from None
    except RecursionError:  # our own json.dumps of a deep tool schema
        raise GrammarError("invalid", f"{spec.kind} grammar is nested too deeply") from None
    m = llguidance.LLMatcher(ll_tok, text, log_level=0, limits=spec.limits.ll())
    if m.is_error():
        raise _refusal(spec.kind, m.get_error(), m.stop_reason())
    return m


def check(spec: GrammarSpec, tokenizer) -> float:
    """Refuse (GrammarError) a spec the last stage could not serve; -> seconds it took.

    The matcher is the worker's (same grammar text, same limits). Its first mask shows an
    unsatisfiable grammar (llguidance stops at once: no token, no end). A grammar too large for
    the limits fails either when built or, for a long forced run such as `a{1000000}`, only at
    the next token (the mask step spends the lexer's fuel and the error waits for a consume): so
    the check walks on, drawing each token from the mask (seeded: the same grammar gets the same
    answer) until `limits.check_tokens` real choices are made (forced runs are followed free, up
    to _MAX_FORCED tokens), and refuses any error or dead end met on the way. A walk is
    not a proof: a limit hit only deep in a rarely taken branch still fails in the worker.
    Every llguidance call here that can take long (build, mask, consume) runs without the GIL:
    a server thread can run this beside its event loop."""
    import llguidance
    import numpy as np

    t0 = time.perf_counter()
    ll_tok = ll_tokenizer(tokenizer)
    m = _compile(spec, ll_tok)
    ends = list(ll_tok.eos_tokens)
    rng = random.Random(0)
    pad = llguidance.LLMatcher(ll_tok, _PAD_GRAMMAR, log_level=0)
    pad = (pad, int(_allowed(pad)[0]))
    choices_made = forced = 0
    while True:
        allowed = _allowed(m)
        if m.is_error():
            raise _refusal(spec.kind, m.get_error(), m.stop_reason())
        choices = allowed[~np.isin(allowed, ends)]
        if not len(choices):
            if m.is_accepting() or m.is_stopped():
                break  # complete: only EOS is left
            if not forced + choices_made:
                raise GrammarError(
                    "unsatisfiable",
                    f"{spec.kind} grammar cannot be satisfied (no output matches it)",
                )
            raise GrammarError(  # the worker would fail a sequence that got here
                "unsatisfiable",
                f"{spec.kind} grammar cannot be satisfied (a dead end after "
                f"{forced + choices_made} tokens)",
            )
        if len(choices) == 1 and forced < _MAX_FORCED:
            # a forced run (`<tool_call>name<arg_key>`, `{"key":`) is followed whole, without a
            # mask per token, and does not use up the walk's choices
            run = m.compute_ff_tokens()[: _MAX_FORCED - forced] or [int(choices[0])]
        else:
            choices_made += 1
            if choices_made > spec.limits.check_tokens:
                break
            run = [int(choices[rng.randrange(len(choices))])]
        # the first token without the GIL (where a spent lexer fails, after tens of ms); the rest
        # of a forced run with it: each is a cheap step of a lexer already in that state
        if not (_consume(m, run[0], pad) and m.consume_tokens(run[1:])):
            raise _refusal(spec.kind, m.get_error(), m.stop_reason())
        forced += len(run) if len(choices) == 1 else 0
    dt = time.perf_counter() - t0
    log.debug("%s grammar checked in %.1f ms", spec.kind, dt * 1e3)
    return dt


_MAX_FORCED = 1024  # forced tokens the walk follows beyond its check_tokens choices


def _allowed(m):
    """The token ids m's next mask allows (computed without the GIL)."""
    import numpy as np

    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
    return np.flatnonzero(bits)


_PAD_GRAMMAR = '{"grammars": [{"lark_grammar": "start: /(?s:.)*/"}]}'


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor(num_threads=1)


def _consume(m, token: int, pad: tuple) -> bool:
    """m.consume_token(token) without the GIL: where a forced run spent the lexer's fuel the
    consume is what fails, after tens of ms of lexer work, and LLMatcher.consume_token holds the
    GIL throughout. llguidance's parallel consume drops it, for two matchers or more: the second
    is a pad (matcher, token) that takes any token, rolled back at once."""
    ok, _ = _executor().consume_token_par([(m, token), pad])
    pad[0].rollback(1)
    return ok


def validate(spec: GrammarSpec, tokenizer) -> None:
    """The edge's check (see `check`): a GrammarError (a ValueError) says what is wrong."""
    check(spec, tokenizer)


# ---- our tokenizers as llguidance tokenizers ----------------------------------------------------
# Read by what a tokenizer offers, not by its class: sampling/ imports nothing of checkpoint/.
# checkpoint/tokenizer.py's HFTokenizer offers `tokenizer_json()` (its tokenizer.json text),
# ByteTokenizer `token_bytes()` (every id's bytes, ids in order) with its bos/eos/pad ids.
class _ByteTokens:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every token's bytes."""

    def __init__(self, tok) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        self.tokens = tok.token_bytes()
        self.special_token_ids = [tok.bos_id, tok.eos_id, tok.pad_id]
        self.encode = tok.encode_bytes  # its space runs (if any) are ids of several bytes

    def __call__(self, data: bytes) -> list[int]:
        return self.encode(data)


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer, n_vocab: int | None = None, eos: int | None = None):
    """llguidance's view of our tokenizer (built once per tokenizer: it indexes the vocabulary)."""
    import llguidance

    if hasattr(tokenizer, "token_bytes"):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer)))
    if hasattr(tokenizer, "tokenizer_json"):
        return llguidance.LLTokenizer(tokenizer.tokenizer_json(), n_vocab=n_vocab, eos_token=eos)
    raise ValueError(
        f"structured output needs the checkpoint's tokenizer; {type(tokenizer).__name__} is "
        "not one llguidance can read"
    )


class GrammarMatcher:
    """One request's grammar state: the mask of allowed next tokens, advanced token by token and
    rolled back when MTP drafts are rejected."""

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int, eos: tuple[int, ...]):
        import llguidance

        self.vocab_size = vocab_size
        self.eos = eos
        # the edge checked this grammar under these same limits (GrammarSpec.limits)
        self.m = llguidance.LLMatcher(
            ll_tokenizer(tokenizer), grammar_text(spec), log_level=0, limits=spec.limits.ll()
        )
        if self.m.is_error():
            raise _refusal(spec.kind, self.m.get_error(), self.m.stop_reason())

    def allowed(self):
        """-> bool [vocab_size]: tokens the grammar allows next (EOS only where it may end)."""
        import numpy as np
        import torch

        # little-endian words: bit j of byte i is token 8 i + j (one numpy pass, no torch ops)
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), np.uint8), bitorder="little")
        n = min(self.vocab_size, bits.size)
        out = np.zeros(self.vocab_size, dtype=np.bool_)
        out[:n] = bits[:n]
        if self.m.is_accepting() or self.m.is_stopped():
            out[list(self.eos)] = True
        return torch.from_numpy(out)

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (the matcher
        is then in error: roll it back)."""
        if token in self.eos:
            return self.m.is_accepting() or self.m.is_stopped()
        return self.m.consume_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    @property
    def done(self) -> bool:
        """The grammar is complete and can take nothing but EOS."""
        return self.m.is_stopped()
