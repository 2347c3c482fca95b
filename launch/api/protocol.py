"""The OpenAI API's request and response bodies as pydantic models, with OpenAI's field names.

Validation happens here, at the edge, so the engine never sees a malformed value: strict types
(no "5" for 5, no 1.5 for an int, no "false" for a bool), finite numbers only, OpenAI's ranges,
text that is valid UTF-8 (a lone surrogate would fail later, inside the tokenizer). What needs the
model (vocabulary size, tokenizer, context length) is checked in `engine_request.py`.

Three kinds of field:
- supported: declared and honoured;
- known but unsupported (OpenAI's or vLLM's): declared with the value that means "off"; any other
  value is refused with a 400 naming the field, never silently ignored (`Unsupported`);
- unknown to both: accepted (extra="allow") and logged by the endpoint, as vLLM does, so clients
  that send extras keep working.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
)

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs; SamplingParams allows the same


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid UTF-8 text ({e.reason} at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]  # < vocabulary size: checked against the model


class Strict(BaseModel):
    """OpenAI's validation, not Python's coercions."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class Refuses(Strict):
    """Declares the known fields it does not support in UNSUPPORTED: field -> the value that
    means "off"; any other value gets a 400 naming the field."""

    UNSUPPORTED: ClassVar[dict[str, Any]] = {}

    @field_validator("*", mode="after")
    @classmethod
    def _supported(cls, v, info):
        off = cls.UNSUPPORTED.get(info.field_name, v)
        if v != off:
            raise ValueError(
                f"{info.field_name}={v!r:.80} is not supported by this server "
                f"(leave it out{'' if off is None else f' or send {off!r}'})"
            )
        return v


class Request(Refuses):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "n": 1,
        "best_of": None,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "use_beam_search": False,
        "allowed_token_ids": None,
        "guided_json": None,
        "guided_regex": None,
        "guided_choice": None,
        "guided_grammar": None,
        "structured_outputs": None,
        "response_format": None,
        "truncate_prompt_tokens": None,
    }

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: Text | None = None
    # vLLM's sampling extras
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[NonEmptyText] | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # known, not supported yet (see UNSUPPORTED); typed so a wrong type is still a 400
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    allowed_token_ids: list[TokenId] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    response_format: Any = None
    truncate_prompt_tokens: Any = None

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class CompletionRequest(Request):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **Request.UNSUPPORTED,
        "echo": False,
        "suffix": None,
    }

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Refuses):
    """One message of a chat. Content is text, or a list of text parts (other part types, tool
    calls and the "tool" role are refused for now)."""

    model_config = ConfigDict(extra="allow")  # e.g. reasoning_content from a previous turn
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "tool_calls": None,
        "tool_call_id": None,
        "function_call": None,
        "audio": None,
    }

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: Text | None = None
    function_call: Any = None
    audio: Any = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(Request):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **Request.UNSUPPORTED,
        "tools": None,
        "tool_choice": None,
        "functions": None,
        "function_call": None,
        "parallel_tool_calls": None,
        "audio": None,
        "modalities": None,
        "prediction": None,
        "reasoning_effort": None,
        "web_search_options": None,
        "echo": False,
        "continue_final_message": False,
        "add_generation_prompt": True,
        "chat_template": None,
        "chat_template_kwargs": None,
        "documents": None,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # accepted and ignored: they change nothing in what is generated
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # known, not supported yet
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[Text] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    echo: bool = False
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None


# ---- responses ---------------------------------------------------------------------------------


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = []


class CompletionChoice(Response):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's: the generated ids
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Response):
    """Only what this chunk adds: {"content": "..."}, or {} with the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(Response):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """OpenAI streams completions as text_completion objects with partial text."""


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dist-glm5"
    max_model_len: int


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorInfo


class Health(Response):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
