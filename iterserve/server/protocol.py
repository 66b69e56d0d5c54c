"""OpenAI request and response bodies (pydantic); the error shape (``APIError``,
``ErrorResponse``) is :mod:`iterserve.openai_http`'s, shared with the router.

pydantic checks JSON types strictly (``true`` is no 1 and no 1.0, ``"0.5"`` no number,
``"yes"`` no ``true``; an integer is a number); value ranges are checked once, by
``SamplingParams`` and the engine's ``RequestLimits``, whose ``InvalidRequestError`` becomes a
400 here like any validation error.
Fields OpenAI defines but iterserve does not implement are declared so that a request using
them gets 400 "not supported" instead of being silently ignored; any other unknown field is
ignored (and logged once).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
)
from typing_extensions import TypedDict

from iterserve.openai_http import APIError as APIError
from iterserve.openai_http import ErrorDetail as ErrorDetail
from iterserve.openai_http import ErrorResponse as ErrorResponse

# OpenAI's limits: completions `logprobs` <= 5, chat `top_logprobs` <= 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def not_supported(feature: str, param: str | None = None) -> APIError:
    """400 for a feature iterserve does not implement; ``param`` defaults to the feature."""
    return APIError(400, f"{feature} is not supported by iterserve", param=param or feature)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names).
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: StrictInt | str | None = None
    # Declared only to refuse them clearly.
    logit_bias: dict[str, StrictFloat] | None = None
    best_of: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

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
            ]
        }
    )

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None

    def unsupported(self) -> APIError | None:
        if self.suffix:
            return not_supported("suffix")
        if self.echo and self.logprobs is not None:
            return not_supported("echo with logprobs (prompt logprobs)", "echo")
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or content parts; only text parts are supported.
    content: str | list[dict[str, Any]] | None = None
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
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    parallel_tool_calls: StrictBool | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages (templated)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"prompt": "Hello!"}, {"messages": [{"role": "user", "content": "Hi"}]}]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [504, 3458, 314]}]})

    model: str | None = None
    tokens: list[StrictInt]


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
