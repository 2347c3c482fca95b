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
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs; SamplingParams allows the same
MAX_N = 128  # OpenAI's limit on choices per request


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


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _with_type(cls, v, info: ValidationInfo):
        if (v is not None) != (info.data.get("type") == "json_schema"):
            raise ValueError("is required with type json_schema, and only then")
        return v


class Request(Refuses):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "best_of": None,
        "use_beam_search": False,
        "allowed_token_ids": None,
        "structured_outputs": None,
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
    n: int = Field(1, ge=1, le=MAX_N)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras (one at most, and not with response_format)
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: list[NonEmptyText] | None = Field(None, min_length=1)
    guided_grammar: NonEmptyText | None = None  # Lark (llguidance's dialect)
    # known, not supported (see UNSUPPORTED); typed so a wrong type is still a 400
    best_of: int | None = Field(None, ge=1)
    use_beam_search: bool = False
    allowed_token_ids: list[TokenId] | None = None
    structured_outputs: Any = None
    truncate_prompt_tokens: Any = None

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class CompletionRequest(Request):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {**Request.UNSUPPORTED, "suffix": None}

    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(Strict):
    name: NonEmptyText
    arguments: Text  # a JSON object, as text (OpenAI's)


class ToolCall(Strict):
    """A tool call of an earlier assistant turn, fed back."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.:-]{1,64}$")]


class Function(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(Refuses):
    """One message of a chat. Content is text, or a list of text parts (other part types are
    refused); an assistant turn may carry tool calls instead of content; a "tool" message answers
    one (tool_call_id)."""

    model_config = ConfigDict(extra="allow")  # e.g. reasoning_content from a previous turn
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"function_call": None, "audio": None}

    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    # declared after role and tool_calls: its validator reads them
    content: Text | list[TextPart] | None = Field(None, validate_default=True)
    function_call: Any = None
    audio: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, v, info: ValidationInfo):
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError(
                "is required (it may be null only in an assistant turn with tool_calls)"
            )
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(Request):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **Request.UNSUPPORTED,
        "functions": None,
        "function_call": None,
        "audio": None,
        "modalities": None,
        "prediction": None,
        "reasoning_effort": None,
        "web_search_options": None,
        "echo": False,
        "continue_final_message": False,
        "chat_template": None,
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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # known, not supported
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[Text] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    echo: bool = False
    continue_final_message: bool = False
    chat_template: Any = None
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


class PromptLogprob(Response):
    """vLLM's prompt_logprobs entry: one per token id (the prompt's and the top ones)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # None for the first prompt token


class CompletionChoice(Response):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's: the generated ids
    prompt_logprobs: PromptLogprobs | None = None


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


class FunctionCallOut(Response):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = []


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's (of the one prompt)


class ToolCallDelta(Response):
    """A whole call in one delta (id, name and arguments), which clients accumulate as any."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class Delta(Response):
    """Only what this chunk adds: {"content": "..."}, tool calls, or {} with the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

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


class Version(Response):
    version: str


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or a chat rendered by the chat template (as for a chat
    completion: tools, add_generation_prompt and chat_template_kwargs included)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(Response):
    prompt: str


Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
TokenizeRequest.model_rebuild()
