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
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "lark", "tool_calls")
# Compact JSON (no free whitespace between tokens): whitespace the grammar allows anywhere is
# what a weak model loops on.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    # json_schema: the schema as JSON text; regex / lark: the grammar; tool_calls: a JSON list
    # of {"name", "parameters"} of the functions a call may name
    text: str = ""
    min_calls: int = 1  # tool_calls: at least this many calls
    max_calls: int = 0  # tool_calls: at most this many (0: no limit)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @staticmethod
    def json_schema(schema: dict) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))

    @staticmethod
    def tool_calls(functions: list[dict], min_calls: int = 1, max_calls: int = 0) -> GrammarSpec:
        """functions: [{"name": ..., "parameters": JSON schema}] (OpenAI's `function` objects)."""
        fs = [{"name": f["name"], "parameters": f.get("parameters") or {}} for f in functions]
        return GrammarSpec("tool_calls", json.dumps(fs, sort_keys=True), min_calls, max_calls)


# ---- GLM tool calls as a Lark grammar -----------------------------------------------------------
# Values of string properties are raw text up to </arg_value> (GLM does not quote them), within the
# property's enum / const / minLength / maxLength / pattern; the others are JSON constrained by the
# property's own schema (%json). Required properties come first, in schema order, then the
# optional ones, each at most once: any output is a call whose arguments validate.
_ANY = "(?s:.)"


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a Lark string literal is a JSON string literal


def _raw_string_rule(name: str, schema: dict) -> str | None:
    """A Lark rule for a string property written raw and closed by </arg_value>, or None if it
    is not a string. A lexeme that may contain '<' cannot be followed by a literal tag (the lexer
    is greedy), so the value and its tag are one lazy lexeme: it ends at the first tag."""
    if schema.get("type") != "string":
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return f'{name}: ({" | ".join(_lark_str(str(v)) for v in values)}) "</arg_value>"'
    if "pattern" in schema:  # JSON schema patterns are searched for, not anchored
        body = f"{_ANY}*({schema['pattern']}){_ANY}*"
    else:
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        body = f"{_ANY}{{{lo},{'' if hi is None else int(hi)}}}"
    return f"{name}[lazy]: /({body})<\\/arg_value>/"


def tool_call_lark(functions: list[dict], min_calls: int = 1, max_calls: int = 0) -> str:
    rules, alts = [], []
    for i, f in enumerate(functions):
        params = f.get("parameters") or {}
        props = params.get("properties") or {}
        required = [k for k in props if k in set(params.get("required") or [])]
        optional = [k for k in props if k not in required]
        parts = []
        for j, key in enumerate(required + optional):
            raw = _raw_string_rule(f"val_{i}_{j}", props[key])
            if raw is None:  # compact JSON, as for response_format (free whitespace loops)
                schema = {**props[key], "x-guidance": JSON_OPTIONS}
                value = f'%json {json.dumps(schema)} "</arg_value>"'
            else:
                value = f"val_{i}_{j}"
                rules.append(raw)
            rules.append(
                f"arg_{i}_{j}: {_lark_str(f'<arg_key>{key}</arg_key><arg_value>')} {value}"
            )
            parts.append(f"arg_{i}_{j}" + ("?" if key in optional else ""))
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


def validate(spec: GrammarSpec, tokenizer) -> None:
    """Raise ValueError naming the problem if the spec does not compile (checked at the edge)."""
    from llguidance import LLMatcher

    err = LLMatcher.validate_grammar(grammar_text(spec), ll_tokenizer(tokenizer))
    if err:
        raise ValueError(f"{spec.kind} grammar does not compile: {err}")


# ---- our tokenizers as llguidance tokenizers ----------------------------------------------------
class _ByteTokens:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every token's bytes."""

    def __init__(self, tok) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>", b"<pad>"]
        self.special_token_ids = [tok.bos_id, tok.eos_id, tok.pad_id]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer, n_vocab: int | None = None, eos: int | None = None):
    """llguidance's view of our tokenizer (built once per tokenizer: it indexes the vocabulary)."""
    import llguidance

    from dist_glm5.checkpoint.tokenizer import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer)))
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=n_vocab, eos_token=eos)
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
        self.m = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar_text(spec), log_level=0)
        if self.m.is_error():
            raise ValueError(f"{spec.kind} grammar does not compile: {self.m.get_error()}")

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
