"""``/v1/chat/completions`` answers: the JSON response and the SSE chunks of a generation run.

A stream opens with one chunk per choice carrying ``{"role": "assistant", "content": ""}``,
then ``content`` deltas; logprobs follow OpenAI's chat shape (``content`` entries with
``token``, ``logprob``, ``bytes`` and ``top_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable

from iterserve.engine.messages import CompletionDelta
from iterserve.engine.outputs import TokenLogprobs
from iterserve.server.generation import Generation
from iterserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
)


class ChatFormatter:
    """Builds chat responses; ``token_text`` gives a token id's text (cached)."""

    def __init__(self, model_name: str, token_text: Callable[[int], str]) -> None:
        self.model_name = model_name
        self.token_text = token_text

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for e in entries:
            top = self._top(e.token_id, e.logprob)
            alternatives = [self._top(t, lp) for t, lp in e.top]
            content.append(ChatLogprobEntry(**top.model_dump(), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    def response(self, gen: Generation) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content=choice.text),
                logprobs=None if gen.logprobs is None else self.logprobs(choice.logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for index, choice in sorted(gen.choices.items())
        ]
        return ChatCompletionResponse(
            id=gen.request_id,
            created=gen.created,
            model=self.model_name,
            choices=choices,
            usage=gen.usage(),
        )

    def first_choices(self, gen: Generation) -> list[ChatStreamChoice]:
        return [
            ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(gen.num_choices)
        ]

    def stream_choice(
        self, gen: Generation, index: int, delta: CompletionDelta
    ) -> ChatStreamChoice | None:
        """The chunk choice for ``delta`` of choice ``index``, or None when it adds nothing."""
        entries = delta.new_logprobs or []
        if not delta.new_text and not entries and delta.finish_reason is None:
            return None
        return ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=delta.new_text or None),
            logprobs=None if gen.logprobs is None else self.logprobs(entries),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )

    def chunk(self, gen: Generation, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=gen.request_id, created=gen.created, model=self.model_name, choices=choices
        )
