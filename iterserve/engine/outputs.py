"""Typed objects that cross layers: scheduler -> runner -> scheduler -> engine -> user."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from iterserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of an iteration.

    ``token_ids`` are the request's tokens at positions
    ``[num_computed_tokens, num_computed_tokens + len(token_ids))``; their KV is written to the
    slots given by ``block_table``. When ``sample`` is set these tokens reach the end of the
    sequence and the runner samples the next token from the last one's logits.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this iteration (tokens with KV, this chunk included)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """The batch of one iteration; decodes come first, then prefill chunks."""

    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous iteration: the runner drops
    # any per-request state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """No tokens to compute (finished or preempted ids may still be listed)."""
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one forward produced: a sampled token for each request with ``sample`` set."""

    sampled_token_ids: dict[str, int]


class ModelRunner(Protocol):
    """The executor seen from the engine (no torch on this side)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the engine uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """A request's output so far; ``finished`` once it has its finish reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
