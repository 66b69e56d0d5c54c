"""A user request as the engine keeps it: ``n`` completions of one prompt, and what each
completion's deltas have sent so far (vLLM's parent request)."""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.engine.messages import CompletionDelta, RequestDelta, TokenLogprobs
from iterserve.engine.request import FINISH_REASONS, Request


@dataclass
class Completion:
    """One completion (a child :class:`Request`) of a user request: its detokenizer, the
    logprobs not sent yet, and how much of its tokens and text the deltas have sent."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    pending_logprobs: list[TokenLogprobs] | None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    sent_final: bool = False

    def take_delta(self) -> CompletionDelta | None:
        """What is new since the previous delta (tokens, visible text, logprobs, the finish
        reason once finished), marked as sent; None when nothing is."""
        request = self.request
        if self.sent_final:
            return None
        done = request.is_finished
        new_token_ids = request.all_token_ids[request.num_prompt_tokens + self.num_sent_tokens :]
        new_text = ""
        if self.detokenizer is not None:
            end = self.detokenizer.num_visible_chars(done)
            new_text = self.detokenizer.text[self.num_sent_chars : end]
        new_logprobs = self.pending_logprobs
        if not (new_token_ids or new_text or new_logprobs or done):
            return None
        if new_logprobs is not None:
            self.pending_logprobs = []
        self.num_sent_tokens += len(new_token_ids)
        self.num_sent_chars += len(new_text)
        self.sent_final = done
        return CompletionDelta(
            self.index,
            new_token_ids,
            new_text,
            new_logprobs,
            FINISH_REASONS.get(request.status),
            request.stop_reason,
        )


class ParentRequest:
    """A user request: ``n`` completions of one prompt (child ids ``{id}#{i}`` when n > 1)."""

    def __init__(self, request_id: str, prompt: str | None, completions: list[Completion]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.completions = completions

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.completions)

    def take_delta(self, changed: list[Completion]) -> RequestDelta:
        """The delta of the ``changed`` completions (those that advanced or finished)."""
        completions = [d for c in changed if (d := c.take_delta()) is not None]
        first = self.completions[0].request
        return RequestDelta(
            self.request_id,
            completions,
            self.finished,
            first.num_cached_tokens or 0,
            first.first_scheduled_time,
        )
