"""``/v1/completions`` answers: the JSON response and the SSE chunks of a generation run.

Choices carry ``text`` (with the prompt in front under ``echo``), OpenAI's completions
logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``: offsets run on
across chunks, counted in characters of the choice's text), ``finish_reason`` and vLLM's
``stop_reason``.
"""

from __future__ import annotations

from collections.abc import Callable

from iterserve.engine.messages import CompletionDelta
from iterserve.engine.outputs import TokenLogprobs
from iterserve.server.generation import Generation
from iterserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
)


class CompletionFormatter:
    """Builds completions responses; ``token_text`` gives a token id's text (cached)."""

    def __init__(self, model_name: str, token_text: Callable[[int], str]) -> None:
        self.model_name = model_name
        self.token_text = token_text

    def logprobs(self, entries: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        """Logprobs of ``entries``, the first token at character ``offset`` of the text."""
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self.token_text(t): lp for t, lp in e.top} for e in entries],
            text_offset=offsets,
        )

    def response(self, gen: Generation) -> CompletionResponse:
        choices = []
        for index in sorted(gen.choices):
            choice = gen.choices[index]
            prompt = gen.prompts[index // gen.params.n]
            prefix = (prompt.text or "") if gen.echo else ""
            logprobs = None
            if gen.logprobs is not None:
                logprobs = self.logprobs(choice.logprobs, len(prefix))
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(
            id=gen.request_id,
            created=gen.created,
            model=self.model_name,
            choices=choices,
            usage=gen.usage(),
        )

    def first_choices(self, gen: Generation) -> list[CompletionChoice]:
        return []  # completions open with the first text

    def stream_choice(
        self, gen: Generation, index: int, delta: CompletionDelta
    ) -> CompletionChoice | None:
        """The chunk choice for ``delta`` of choice ``index``, or None when it adds nothing."""
        entries = delta.new_logprobs or []
        if not delta.new_text and not entries and delta.finish_reason is None:
            return None
        choice = gen.choices[index]
        text = delta.new_text
        if gen.echo and not choice.started:
            echo = gen.prompts[index // gen.params.n].text or ""
            text = echo + text
            choice.text_offset = len(echo)
        choice.started = True
        logprobs = None
        if gen.logprobs is not None:
            logprobs = self.logprobs(entries, choice.text_offset)
            choice.text_offset += sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )

    def chunk(self, gen: Generation, choices: list[CompletionChoice]) -> CompletionChunk:
        return CompletionChunk(
            id=gen.request_id, created=gen.created, model=self.model_name, choices=choices
        )
