"""OpenAI request and response bodies (pydantic); the error shape (``APIError``,
``ErrorResponse``) is :mod:`iterserve.openai_http`'s, shared with the router.

pydantic checks JSON types strictly (``true`` is no 1 and no 1.0, ``"0.5"`` no number,
``"yes"`` no ``true``; an integer is a number, and ``2.0`` an integer as in JSON Schema); value
ranges are checked once, by ``SamplingParams`` and the engine's ``RequestLimits``, whose
``InvalidRequestError`` becomes a 400 here like any validation error. The models' JSON schema
(``/openapi.json``) states those ranges and the rules between fields wherever JSON Schema can
(:func:`checked`), so a body valid under it is accepted unless a runtime limit (the context
length, the number of sequences) or a setting in force refuses it.
Fields OpenAI defines but iterserve does not implement are declared so that a request using
them gets 400 "not supported" instead of being silently ignored; any other unknown field is
ignored (and logged once).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    WithJsonSchema,
    model_serializer,
)
from typing_extensions import TypedDict

from iterserve.config import MAX_JSON_INT, MAX_TIER_NAME_LEN
from iterserve.engine.sampling_params import (
    MAX_ABS_PENALTY,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
)
from iterserve.openai_http import APIError as APIError
from iterserve.openai_http import ErrorDetail as ErrorDetail
from iterserve.openai_http import ErrorResponse as ErrorResponse

# OpenAI's limits: completions `logprobs` <= 5, chat `top_logprobs` <= 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20

# Component schemas only the running server can fill in (``/openapi.json`` does when it is
# built): a token id's maximum (the vocabulary size - 1), the names of the live tiers.
TOKEN_ID_SCHEMA_NAME = "TokenId"
TIER_NAME_SCHEMA_NAME = "TierName"


def _integral(value: Any) -> Any:
    """A JSON number with no fractional part (``2.0``) as the int it is (JSON Schema's
    ``integer`` includes it); anything else, booleans included, as it came."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field of a request: a JSON integer, ``2.0`` included; never ``true`` or ``"2"``.
JsonInt = Annotated[StrictInt, BeforeValidator(_integral)]
TOKEN_ID_REF = {"$ref": f"#/components/schemas/{TOKEN_ID_SCHEMA_NAME}"}
TokenId = Annotated[JsonInt, WithJsonSchema(TOKEN_ID_REF)]
_TEXT = {"type": "string", "minLength": 1}
# A tier name as far as a pattern can say what the server refuses: blank, control characters,
# over MAX_TIER_NAME_LEN characters (it also refuses format, private-use and unassigned ones).
_CONTROL = r"\u0000-\u001f\u007f-\u009f"
TIER_NAME_SCHEMA = {
    "type": "string",
    "pattern": rf"^[^{_CONTROL}]*[^\s{_CONTROL}][^{_CONTROL}]*$",
    "maxLength": MAX_TIER_NAME_LEN,
}


def checked(default: Any = None, **keywords: Any) -> Any:
    """A field's default and the JSON Schema ``keywords`` (bounds) that the server checks
    itself (``SamplingParams``, the engine's ``RequestLimits``, the endpoints): stated in
    ``/openapi.json`` without pydantic checking them a second time, so a refusal keeps the
    server's message and ``param``."""
    return Field(default, json_schema_extra=keywords)


def _only_with(field: str, kind: str, needs: str) -> dict[str, Any]:
    """JSON Schema: a ``field`` of JSON type ``kind`` (not null) needs ``needs: true``."""
    return {
        "if": {"required": [field], "properties": {field: {"type": kind}}},
        "then": {"required": [needs], "properties": {needs: {"const": True}}},
    }


# ``stream_options`` only with ``stream: true`` (either endpoint).
_STREAM_OPTIONS_NEED_STREAM = _only_with("stream_options", "object", "stream")


def not_supported(feature: str, param: str | None = None) -> APIError:
    """400 for a feature iterserve does not implement; ``param`` defaults to the feature."""
    return APIError(400, f"{feature} is not supported by iterserve", param=param or feature)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: JsonInt = checked(1, minimum=1, maximum=MAX_N)
    temperature: StrictFloat | None = checked(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: StrictFloat | None = checked(exclusiveMinimum=0, maximum=1)
    stop: Annotated[
        str | list[str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    _TEXT,
                    {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS},
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    seed: JsonInt | None = checked(minimum=-(2**63), maximum=2**63 - 1)
    presence_penalty: StrictFloat = checked(0.0, minimum=-MAX_ABS_PENALTY, maximum=MAX_ABS_PENALTY)
    frequency_penalty: StrictFloat = checked(0.0, minimum=-MAX_ABS_PENALTY, maximum=MAX_ABS_PENALTY)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names).
    top_k: JsonInt | None = checked(minimum=-1, maximum=MAX_TOP_K)
    min_p: StrictFloat | None = checked(minimum=0, maximum=1)
    repetition_penalty: StrictFloat | None = checked(
        minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY
    )
    min_tokens: JsonInt = checked(0, minimum=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Annotated[
        JsonInt | str | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "integer",
                        "exclusiveMinimum": -MAX_JSON_INT,
                        "exclusiveMaximum": MAX_JSON_INT,
                    },
                    {"$ref": f"#/components/schemas/{TIER_NAME_SCHEMA_NAME}"},
                    {"type": "null"},
                ],
                "description": "an integer (lower is more urgent) or a tier's name",
            }
        ),
    ] = None
    # Declared only to refuse them clearly: the schema allows only their "off" values.
    logit_bias: dict[str, StrictFloat] | None = checked(maxProperties=0)
    best_of: JsonInt | None = checked(description="only null or n (one completion per choice)")
    response_format: dict[str, Any] | None = checked(properties={"type": {"enum": ["text", None]}})
    tools: list[Any] | None = checked(maxItems=0)
    tool_choice: Any = checked(enum=["none", None])
    functions: list[Any] | None = checked(maxItems=0)
    function_call: Any = checked(enum=["none", None])

    def unsupported(self) -> APIError | None:
        """400 "not supported" for the first requested feature iterserve does not implement."""
        if self.logit_bias:
            return not_supported("logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            return not_supported("best_of")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return not_supported("response_format")
        if self.tools:
            return not_supported("tools")
        if self.tool_choice not in (None, "none"):
            return not_supported("tool_choice")
        if self.functions:
            return not_supported("functions")
        if self.function_call not in (None, "none"):
            return not_supported("function_call")
        return None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _STREAM_OPTIONS_NEED_STREAM,
                {  # echo with logprobs (prompt logprobs): not supported
                    "not": {
                        "required": ["echo", "logprobs"],
                        "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}},
                    }
                },
            ],
            "examples": [
                {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
                {
                    "prompt": ["Once upon a time", "Hello"],
                    "max_tokens": 4,
                    "n": 2,
                    "logprobs": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ],
        }
    )

    prompt: Annotated[
        str | list[str] | list[JsonInt] | list[list[JsonInt]],
        WithJsonSchema(
            {
                "anyOf": [
                    _TEXT,
                    {"type": "array", "items": _TEXT, "minItems": 1},
                    {"type": "array", "items": TOKEN_ID_REF, "minItems": 1},
                    {
                        "type": "array",
                        "items": {"type": "array", "items": TOKEN_ID_REF, "minItems": 1},
                        "minItems": 1,
                    },
                ],
                "description": "a text, texts, token ids, or lists of token ids (none empty)",
            }
        ),
    ]
    max_tokens: JsonInt | None = checked(16, minimum=1)
    logprobs: JsonInt | None = checked(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = checked(maxLength=0, description="not supported: only empty")

    def unsupported(self) -> APIError | None:
        if self.suffix:
            return not_supported("suffix")
        if self.echo and self.logprobs is not None:
            return not_supported("echo with logprobs (prompt logprobs)", "echo")
        return super().unsupported()


_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={  # only an assistant turn may come without content
            "if": {"properties": {"role": {"const": "assistant"}}},
            "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        },
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or content parts; only text parts are supported.
    content: Annotated[
        str | list[dict[str, Any]] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": _TEXT_PART},
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    name: str | None = None

    def text(self) -> str:
        """The message's text.

        Raises:
            APIError: 400 for no content outside an assistant message (as OpenAI), or a
                non-text content part (images, audio: not supported).
        """
        if self.content is None:
            if self.role != "assistant":  # only an assistant turn may come without content
                raise APIError(400, f"a {self.role!r} message needs 'content'", param="messages")
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise not_supported(f"message content of type {part.get('type')!r}", "messages")
            if not isinstance(part.get("text"), str):
                raise APIError(400, "a text content part needs a string 'text'", param="messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _STREAM_OPTIONS_NEED_STREAM,
                _only_with("top_logprobs", "integer", "logprobs"),
            ],
            "examples": [
                {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    ],
                    "max_completion_tokens": 4,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ],
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JsonInt | None = checked(minimum=1)
    max_completion_tokens: JsonInt | None = checked(minimum=1)
    logprobs: StrictBool = False
    top_logprobs: JsonInt | None = checked(minimum=0, maximum=MAX_CHAT_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    parallel_tool_calls: StrictBool | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages (templated)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [  # exactly one of them, not null
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ],
            "examples": [{"prompt": "Hello!"}, {"messages": [{"role": "user", "content": "Hi"}]}],
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = checked(minItems=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [504, 3458, 314]}]})

    model: str | None = None
    tokens: list[TokenId]


# ----------------------------------------------------------------- responses (OpenAI's shapes)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Completions' logprobs: one entry per token; ``text_offset`` in characters of the text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class SentDelta(TypedDict, total=False):
    """A delta as sent (its schema in /openapi.json): the fields set, none of them null."""

    role: Literal["assistant"]
    content: str


class DeltaMessage(BaseModel):
    """A chat chunk's delta: only the fields it sets are sent (``{}`` for none)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _drop_unset(self) -> SentDelta:
        sent = SentDelta()
        if self.role is not None:
            sent["role"] = self.role
        if self.content is not None:
            sent["content"] = self.content
        return sent


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A streamed completions chunk (OpenAI reuses the ``text_completion`` object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------- other response bodies


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None
    max_model_len: int  # tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # tokens
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
