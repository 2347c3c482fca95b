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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dist_glm5.sampling.grammar import GrammarError, GrammarSpec
from dist_glm5.sampling.params import SamplingParams

from .chat_template import ChatTemplate
from .errors import ApiError
from .limits import DEFAULT_LIMITS, Limits
from .protocol import ChatCompletionRequest, CompletionRequest, Request
from .structured_checks import check_grammar, check_tool_parameters, tool_grammar

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
class Choice:
    """One engine request of an API request: choice `index` of OpenAI's answer."""

    index: int
    prompt: list[int]
    params: SamplingParams
    prompt_index: int = 0


@dataclass(frozen=True)
class EngineRequest:
    """An API request as engine requests: every prompt (a completion may batch several) times
    `n` choices, each its own sequence with its own seed (seed + j for the j-th choice of a prompt
    when the request has a seed; a random one otherwise)."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1
    echo: list[str] | None = None  # completions: each prompt's text, put before its choices
    logprobs: int | None = None  # top-n per generated token the client asked for
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs the client asked for
    tools: dict[str, dict] | None = None  # parse tool calls: function name -> its parameters

    @property
    def prompt(self) -> list[int]:
        return self.prompts[0]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def choices(self) -> list[Choice]:
        out = []
        for i, prompt in enumerate(self.prompts):
            for j in range(self.n):
                p = self.params
                if j and p.seed is not None:
                    p = replace(p, seed=(p.seed + j) % (1 << 63))
                out.append(Choice(i * self.n + j, prompt, p, i))
        return out


def completion_request(
    req: CompletionRequest, m: ModelInfo, limits: Limits = DEFAULT_LIMITS
) -> EngineRequest:
    _common_checks(req, m)
    prompt = req.prompt
    batch = (
        prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        else [prompt]
    )
    if len(batch) * req.n > limits.max_choices:
        raise ApiError(
            400,
            f"{len(batch)} prompts x n={req.n} is more than {limits.max_choices} choices in one "
            "request (--max-choices)",
            "prompt" if len(batch) > limits.max_choices else "n",
            "limit_exceeded",
        )
    prompts, texts = [], []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt.{i}"
        if isinstance(p, str):
            check_chars(p, limits, "prompt", where)
            ids = _encode(m, p, "prompt", where)
        else:
            ids = list(p)
            if not ids:
                raise ApiError(400, f"{where}: the prompt is empty", "prompt")
            _check_ids(ids, m, "prompt")
        prompts.append(ids)
        if req.echo:
            texts.append(p if isinstance(p, str) else _decode(m, ids))
    want_plp = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # the echoed prompt comes with its logprobs
        want_plp = max(req.logprobs, want_plp or 0)
    return _engine_request(
        req,
        m,
        prompts,
        req.max_tokens,
        req.logprobs,
        prompt_logprobs=want_plp,
        echo=texts if req.echo else None,
    )


def chat_request(
    req: ChatCompletionRequest, m: ModelInfo, limits: Limits = DEFAULT_LIMITS
) -> EngineRequest:
    _common_checks(req, m)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if m.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids")
    if req.n > limits.max_choices:
        raise ApiError(
            400,
            f"n={req.n} is more than {limits.max_choices} choices in one request (--max-choices)",
            "n",
            "limit_exceeded",
        )
    tools, grammar = _tools(req, m)
    text = render_chat(m, req.messages, req.tools, req)
    check_chars(text, limits, "messages", "messages (rendered by the chat template)")
    ids = _encode(m, text, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _engine_request(req, m, [ids], max_tokens, logprobs, tools=tools, tool_grammar=grammar)


def check_chars(text: str, limits: Limits, param: str, where: str) -> None:
    """Before tokenising: a text this long costs seconds to encode and cannot fit anyway."""
    if len(text) > limits.max_prompt_chars:
        raise ApiError(
            400,
            f"{where} has {len(text)} characters; this server tokenizes at most "
            f"{limits.max_prompt_chars} (--max-prompt-chars)",
            param,
            "limit_exceeded",
        )


def render_chat(m: ModelInfo, messages, tools, options) -> str:
    """The chat as text, by the model's chat template (tools and chat_template_kwargs passed)."""
    dicts = []
    for x in messages:
        d = {"role": x.role, "content": x.text}
        if x.name is not None:
            d["name"] = x.name
        if x.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in x.tool_calls]
        if x.tool_call_id is not None:
            d["tool_call_id"] = x.tool_call_id
        dicts.append(d)
    kwargs = dict(options.chat_template_kwargs or {})
    try:
        return m.chat_template.render(
            dicts,
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            add_generation_prompt=options.add_generation_prompt,
            **kwargs,
        )
    except Exception as e:  # the template's own raise_exception, or a template error
        raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e


def _tools(req: ChatCompletionRequest, m: ModelInfo) -> tuple[dict | None, GrammarSpec | None]:
    """-> (the functions to parse calls of, or None: no parsing; the grammar forcing calls)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None, None
    funcs = {}
    for i, t in enumerate(req.tools):
        if t.function.name in funcs:
            raise ApiError(400, f"two tools are named {t.function.name!r}", "tools")
        check_tool_parameters(i, t.function.parameters)
        funcs[t.function.name] = t.function.parameters or {"type": "object", "properties": {}}
    choice = choice or "auto"
    if choice == "none":
        return None, None
    if choice == "auto":
        return funcs, None
    if isinstance(choice, str):  # "required": one call or more, one without parallel calls
        named, most = list(funcs), 1 if req.parallel_tool_calls is False else 0
    else:
        if choice.function.name not in funcs:
            raise ApiError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        named, most = [choice.function.name], 1  # as OpenAI and vLLM: exactly one call of it
    return funcs, tool_grammar(req.tools, named, most, m.tokenizer)


def _grammar(req: Request, m: ModelInfo) -> GrammarSpec | None:
    """response_format, or one of vLLM's guided_* fields, as a grammar (at most one)."""
    given = [
        k
        for k in (
            "response_format",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        )
        if getattr(req, k) is not None
        and not (k == "response_format" and req.response_format.type == "text")
    ]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}, not several", given[1])
    k = given[0]
    try:
        if k == "response_format":
            rf = req.response_format
            if rf.type == "json_object":
                spec = GrammarSpec("json_object")
            else:
                spec = GrammarSpec.json_schema(rf.json_schema.schema_)
        elif k == "guided_json":
            schema = req.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ApiError(400, f"guided_json is not JSON: {e}", k) from None
            spec = GrammarSpec.json_schema(schema)
        elif k == "guided_regex":
            spec = GrammarSpec("regex", req.guided_regex)
        elif k == "guided_choice":
            spec = GrammarSpec("regex", "|".join(re.escape(c) for c in req.guided_choice))
        else:
            spec = GrammarSpec("lark", req.guided_grammar)
    except GrammarError as e:  # a schema too deep to serialise
        raise ApiError(400, f"{k}: {e}", k) from None
    _validate_grammar(spec, m, k)
    return spec


def _validate_grammar(spec: GrammarSpec, m: ModelInfo, param: str) -> None:
    check_grammar(spec, m.tokenizer, param)  # compiled as the last stage will: a 400 if not


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


def _engine_request(
    req: Request,
    m: ModelInfo,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    echo: list[str] | None = None,
    tools: dict | None = None,
    tool_grammar: GrammarSpec | None = None,
) -> EngineRequest:
    longest = max(prompts, key=len)
    room = m.max_model_len - len(longest)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f" + max_tokens={max_tokens}" if max_tokens is not None else ""
        raise ApiError(
            400,
            f"this model's maximum context length is {m.max_model_len} tokens; the request has "
            f"{len(longest)} prompt tokens{asked}",
            "max_tokens" if room >= 1 else ("messages" if hasattr(req, "messages") else "prompt"),
            "context_length_exceeded",
        )
    max_tokens = max_tokens or room  # as vLLM: what the context leaves
    if req.min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens={req.min_tokens} is more than max_tokens={max_tokens}", "min_tokens"
        )
    # list lengths were counted against their limits before validation (serving.parse_body)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(dict.fromkeys(req.stop or ()))
    if stop and m.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; use stop_token_ids", "stop")
    stop_ids = tuple(dict.fromkeys(req.stop_token_ids or ()))
    _check_ids(stop_ids, m, "stop_token_ids")
    bad_words = _bad_words(req.bad_words, m)
    grammar = _grammar(req, m)
    if grammar is not None and tool_grammar is not None:
        raise ApiError(
            400, "response_format cannot be combined with a forced tool call", "response_format"
        )
    grammar = grammar or tool_grammar
    if grammar is not None and req.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with structured output", "ignore_eos")
    plp = prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs
    try:
        params = SamplingParams(
            **_sampling(req, m),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop_token_ids=stop_ids,
            stop=stop,
            bad_words=bad_words,
            logit_bias=_logit_bias(req.logit_bias, m),
            logprobs=logprobs,
            prompt_logprobs=plp,
            ignore_eos=req.ignore_eos,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty,
            grammar=grammar,
            # a tool call's tags may be special tokens: the parser must see them (as vLLM's glm45)
            skip_special_tokens=req.skip_special_tokens and tools is None,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:  # SamplingParams' own checks name the field first
        field = re.match(r"[a-z_]+", str(e))  # "top_k=2.5 ...", "logit_bias entry ..."
        raise ApiError(400, str(e), field.group(0) if field else None) from None
    so = req.stream_options
    return EngineRequest(
        prompts,
        params,
        req.stream,
        include_usage=bool(so and so.include_usage),
        continuous_usage=bool(so and so.continuous_usage_stats),
        n=req.n,
        echo=echo,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        tools=tools,
    )


def _sampling(req: Request, m: ModelInfo) -> dict:
    d = m.defaults

    def pick(name: str, off):  # the request's value, else the model's default, else off
        return next(v for v in (getattr(req, name), d.get(name), off) if v is not None)

    temperature = pick("temperature", 1.0)  # OpenAI's default
    if 0 < temperature < MIN_TEMPERATURE:  # as vLLM: logits / 1e-300 overflow to inf
        log.warning("temperature %g raised to %g", temperature, MIN_TEMPERATURE)
        temperature = MIN_TEMPERATURE
    return dict(
        temperature=temperature,
        top_p=pick("top_p", 1.0),
        top_k=max(pick("top_k", 0), 0),  # -1 is vLLM's "off"
        min_p=pick("min_p", 0.0),
    )


def _bad_words(words: list[str] | None, m: ModelInfo) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids, and (as vLLM) those of the word after a space, which a BPE
    tokenizer spells differently: a banned word is banned at the start of a text and inside it."""
    out: dict[tuple[int, ...], None] = {}  # ordered, and de-duplicated in linear time
    for w in dict.fromkeys(words or ()):
        ids = tuple(_encode(m, w, "bad_words"))
        spaced = tuple(m.tokenizer.encode(" " + w.lstrip(" ")))
        # the spaced form's own tokens, when the space merges into the word's first token
        for form in (ids, spaced):
            if form and (form is ids or form[1:] != ids):
                out[form] = None
    return tuple(out)


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


def _encode(m: ModelInfo, text: str, param: str, where: str | None = None) -> list[int]:
    where = where or param
    if m.tokenizer is None:
        raise ApiError(400, f"{where}: this model has no tokenizer; give token ids", param)
    ids = m.tokenizer.encode(text)
    if not ids:
        raise ApiError(400, f"{where}: the text is empty", param)
    return ids


def _decode(m: ModelInfo, ids: list[int]) -> str:
    return m.tokenizer.decode(ids) if m.tokenizer is not None else ""
