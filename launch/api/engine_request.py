"""A validated OpenAI request turned into what the engine takes: prompt token ids and
SamplingParams.

The checks that need the model live here (the pydantic models cannot know it): token ids inside
the vocabulary, text that needs a tokenizer, the context length, cross-field rules. Each failure is
a 400 naming the field; the engine never sees a value it could choke on.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dist_glm5.sampling.params import SamplingParams

from .chat_template import ChatTemplate
from .errors import ApiError
from .protocol import ChatCompletionRequest, CompletionRequest, Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the server knows of the model it fronts."""

    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any = None  # encode(str) -> ids, decode(ids) -> str; None: token ids only
    chat_template: ChatTemplate = field(default_factory=lambda: ChatTemplate(None))
    defaults: dict[str, Any] = field(default_factory=dict)  # generation_config.json's sampling

    @classmethod
    def from_model_dir(
        cls, d: str | Path, name: str, max_model_len: int, vocab_size: int, tokenizer
    ) -> ModelInfo:
        """The chat template from tokenizer_config.json and, as vLLM, the sampling defaults from
        generation_config.json when the checkpoint has one."""
        gc = Path(d) / "generation_config.json"
        gen = json.loads(gc.read_text()) if gc.exists() else {}
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in gen}
        return cls(
            name, max_model_len, vocab_size, tokenizer, ChatTemplate.from_model_dir(d), defaults
        )


@dataclass(frozen=True)
class EngineRequest:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False


def completion_request(req: CompletionRequest, m: ModelInfo) -> EngineRequest:
    _common_checks(req, m)
    if req.logprobs is not None and req.stream:
        _unsupported("logprobs", "with stream")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            _unsupported("prompt", "as a batch of several prompts")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = _encode(m, prompt, "prompt")
    else:
        ids = list(prompt)
        _check_ids(ids, m, "prompt")
    return _engine_request(req, m, ids, req.max_tokens, req.logprobs)


def chat_request(req: ChatCompletionRequest, m: ModelInfo) -> EngineRequest:
    _common_checks(req, m)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.logprobs and req.stream:
        _unsupported("logprobs", "with stream")
    if m.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids")
    messages = [{"role": x.role, "content": x.text} for x in req.messages]
    try:
        text = m.chat_template.render(messages)
    except Exception as e:  # the template's own raise_exception, or a template error
        raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e
    ids = _encode(m, text, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _engine_request(req, m, ids, max_tokens, logprobs)


def _common_checks(req: Request, m: ModelInfo) -> None:
    if unknown := req.unknown_fields:  # repr: a name may hold any character
        names = ", ".join(repr(k)[:40] for k in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        log.warning("ignoring fields unknown to OpenAI and vLLM: %s%s", names, more)
    if req.model is not None and req.model != m.name:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist; this server serves {m.name!r}",
            "model",
            "model_not_found",
        )
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        _unsupported("prompt_logprobs", "with stream")


def _engine_request(
    req: Request, m: ModelInfo, ids: list[int], max_tokens: int | None, logprobs: int | None
) -> EngineRequest:
    room = m.max_model_len - len(ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f" + max_tokens={max_tokens}" if max_tokens is not None else ""
        raise ApiError(
            400,
            f"this model's maximum context length is {m.max_model_len} tokens; the request has "
            f"{len(ids)} prompt tokens{asked}",
            "max_tokens" if room >= 1 else ("messages" if hasattr(req, "messages") else "prompt"),
            "context_length_exceeded",
        )
    max_tokens = max_tokens or room  # as vLLM: what the context leaves
    if req.min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens={req.min_tokens} is more than max_tokens={max_tokens}", "min_tokens"
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if stop and m.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; use stop_token_ids", "stop")
    stop_ids = tuple(req.stop_token_ids or ())
    _check_ids(stop_ids, m, "stop_token_ids")
    bad_words = tuple(tuple(_encode(m, w, "bad_words")) for w in req.bad_words or ())
    try:
        params = _params(req, m, ids, max_tokens, logprobs, stop, stop_ids, bad_words)
    except ValueError as e:  # SamplingParams' own checks name the field first
        raise ApiError(400, str(e), str(e).split("=")[0]) from None
    so = req.stream_options
    return EngineRequest(
        ids,
        params,
        req.stream,
        include_usage=bool(so and so.include_usage),
        continuous_usage=bool(so and so.continuous_usage_stats),
    )


def _params(req, m, ids, max_tokens, logprobs, stop, stop_ids, bad_words) -> SamplingParams:
    d = m.defaults

    def pick(name: str, off):  # the request's value, else the model's default, else off
        return next(v for v in (getattr(req, name), d.get(name), off) if v is not None)

    temperature = pick("temperature", 1.0)  # OpenAI's default
    if 0 < temperature < MIN_TEMPERATURE:  # as vLLM: logits / 1e-300 overflow to inf
        log.warning("temperature %g raised to %g", temperature, MIN_TEMPERATURE)
        temperature = MIN_TEMPERATURE
    return SamplingParams(
        temperature=temperature,
        top_p=pick("top_p", 1.0),
        top_k=max(pick("top_k", 0), 0),  # -1 is vLLM's "off"
        min_p=pick("min_p", 0.0),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop_token_ids=stop_ids,
        stop=stop,
        bad_words=bad_words,
        logit_bias=_logit_bias(req.logit_bias, m),
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        ignore_eos=req.ignore_eos,
    )


MIN_TEMPERATURE = 0.01
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")


def _logit_bias(bias: dict[str, float] | None, m: ModelInfo) -> dict[int, float]:
    out = {}
    for k, v in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(k):
            raise ApiError(400, f"logit_bias key {k!r:.40} is not a token id", "logit_bias")
        out[int(k)] = v
    _check_ids(list(out), m, "logit_bias")
    return out


def _check_ids(ids, m: ModelInfo, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < m.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"{param}: token ids {bad[:5]} are outside the vocabulary 0..{m.vocab_size - 1}",
            param,
        )


def _encode(m: ModelInfo, text: str, param: str) -> list[int]:
    if m.tokenizer is None:
        raise ApiError(400, f"{param}: this model has no tokenizer; give token ids", param)
    ids = m.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, f"{param}: the text is empty", param)
    return ids


def _unsupported(param: str, how: str) -> None:
    raise ApiError(400, f"{param} {how} is not supported by this server", param)
