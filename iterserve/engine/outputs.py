"""Typed objects that cross layers: scheduler -> runner -> scheduler -> engine -> user."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

# TokenLogprobs is defined with the messages (it crosses the boundary); imported from here too.
from iterserve.engine.messages import RequestDelta, TokenLogprobs
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
    # The request's prompt (a shared reference, never copied): the runner builds its
    # per-request sampling state (repetition penalty) from it the first time it sees the id.
    prompt_token_ids: list[int] = field(default_factory=list)

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
    # KV block copies to make before the forward, in this order: (device, host) pairs of
    # swapped-out requests, then (host, device) pairs of swapped-in ones.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """No tokens to compute (finished or preempted ids, or swaps, may still be listed)."""
        return not self.scheduled

    @property
    def has_runner_work(self) -> bool:
        """Anything at all for the runner: tokens, swaps, or per-request state to drop."""
        return bool(
            self.scheduled
            or self.finished_request_ids
            or self.preempted_request_ids
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
        )


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one forward produced: a sampled token for each request with ``sample`` set, and
    its logprobs for requests that asked for them."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner(Protocol):
    """The executor seen from the engine (no torch on this side).

    ``execute_model`` makes the block copies of the output, then runs the forward of its
    scheduled requests and samples.
    """

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's shape); text and token ids so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # The stop string or stop token id that ended it (None for EOS or length).
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """A request's output so far; ``finished`` once it has its finish reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Seconds of the engine's clock: when the request was accepted, when first admitted.
    arrival_time: float | None = None
    first_scheduled_time: float | None = None


class OutputAccumulator:
    """Folds a request's :class:`~iterserve.engine.messages.RequestDelta` s into its
    cumulative :class:`RequestOutput` (what ``LLM.generate`` returns and a non-streamed HTTP
    answer needs), on the client's side of the engine boundary.

    Args:
        request_id, prompt, prompt_token_ids: as the request was added.
        n: number of completions.
        logprobs: whether the request asked for logprobs (``CompletionOutput.logprobs`` is a
            list then, else None).
        arrival_time: when the request was accepted (seconds).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        n: int,
        logprobs: bool,
        arrival_time: float | None = None,
    ) -> None:
        completions = [
            CompletionOutput(i, "", [], logprobs=[] if logprobs else None) for i in range(n)
        ]
        self.output = RequestOutput(
            request_id, prompt, prompt_token_ids, completions, False, arrival_time=arrival_time
        )

    def add(self, delta: RequestDelta) -> RequestOutput:
        """Apply ``delta`` in place; the (same, updated) cumulative output."""
        out = self.output
        for d in delta.completions:
            c = out.outputs[d.index]
            c.text += d.new_text
            c.token_ids.extend(d.new_token_ids)
            if d.new_logprobs is not None and c.logprobs is not None:
                c.logprobs.extend(d.new_logprobs)
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
        out.finished = delta.finished
        out.num_cached_tokens = delta.num_cached_tokens
        if delta.first_scheduled_time is not None:
            out.first_scheduled_time = delta.first_scheduled_time
        return out

    def snapshot(self) -> RequestOutput:
        """A copy of the output as of now (later deltas do not change it)."""
        out = self.output
        completions = [
            dataclasses.replace(
                c,
                token_ids=list(c.token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs),
            )
            for c in out.outputs
        ]
        return dataclasses.replace(out, outputs=completions)
