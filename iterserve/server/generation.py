"""One HTTP generation request as it runs: its engine requests, their deltas, disconnects.

A request of either endpoint becomes one engine request per prompt (a batch of prompts in
``/v1/completions`` becomes several), each with ``n`` completions; choice ``i`` of the answer
is completion ``i % n`` of prompt ``i // n``. :class:`GenerationRun` queues them all at once
and runs each on a task that owns its bookkeeping (admission counts, latency metrics), so
nothing leaks even if a streamed body is never read. Their deltas and a disconnect watcher
feed one queue: a client that goes away, streaming or not and even while still queued, is
noticed at once and its engine requests are aborted (their KV blocks are free at the engine's
next iteration boundary). A streaming client that reads slower than the engine writes lets
that queue grow: past a bound the run calls ``on_overflow`` (the response drops the client,
:mod:`~iterserve.server.streaming`). The formatters (:mod:`~iterserve.server.completions`,
:mod:`~iterserve.server.chat`) turn what arrives into OpenAI responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.messages import (
    AddRequest,
    CompletionDelta,
    EngineDeadError,
    RequestAbortedError,
    RequestDelta,
    RequestFailedError,
)
from iterserve.engine.outputs import TokenLogprobs
from iterserve.engine.sampling_params import SamplingParams
from iterserve.server.metrics import RequestTracker
from iterserve.server.protocol import APIError, PromptTokensDetails, UsageInfo
from iterserve.server.state import ServerState
from iterserve.server.tenants import DEFAULT_TENANT

_DISCONNECTED = object()


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None


@dataclass
class Choice:
    """One choice of the answer: what has arrived of it (and, streaming, been sent)."""

    num_tokens: int = 0
    text_pieces: list[str] = field(default_factory=list)  # non-streamed answers only
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # non-streamed answers only
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0  # text_offset of the next logprobs token (completions, streamed)
    started: bool = False  # a chunk of it was sent (streamed: the echo goes first)

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)


@dataclass
class Generation:
    """A validated generation request of either endpoint.

    Attributes:
        request_id: ``cmpl-...`` / ``chatcmpl-...``, the response id and ``X-Request-Id``.
        priority: resolved integer priority; ``tier`` its tier's name (metric label).
        tenant: :func:`~iterserve.server.tenants.resolve_tenant` of the request.
        arrival_time: when the HTTP request was accepted (server clock, seconds).
        logprobs: completions: the top count; chat: ``top_logprobs`` (None: off).
    """

    kind: str  # "completion" | "chat"
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    priority: int
    tier: str
    arrival_time: float
    created: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    tenant: str = DEFAULT_TENANT
    choices: dict[int, Choice] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    disconnected: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def engine_id(self, prompt_idx: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_idx}"

    def choice_index(self, prompt_idx: int, completion_idx: int) -> int:
        return prompt_idx * self.params.n + completion_idx

    def usage(self) -> UsageInfo:
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = sum(c.num_tokens for c in self.choices.values())
        return UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.num_cached_tokens.values())
            ),
        )

    def record(self, prompt_idx: int, delta: RequestDelta) -> list[tuple[int, CompletionDelta]]:
        """Fold one engine delta into the choices; the (choice index, delta) pairs in it."""
        self.num_cached_tokens[prompt_idx] = delta.num_cached_tokens
        pairs = []
        for d in delta.completions:
            index = self.choice_index(prompt_idx, d.index)
            choice = self.choices.setdefault(index, Choice())
            choice.num_tokens += len(d.new_token_ids)
            if not self.stream:
                choice.text_pieces.append(d.new_text)
                if d.new_logprobs is not None:
                    choice.logprobs.extend(d.new_logprobs)
            choice.finish_reason = d.finish_reason
            choice.stop_reason = d.stop_reason
            pairs.append((index, d))
        return pairs


class GenerationRun:
    """The running engine requests of a :class:`Generation`.

    :meth:`start` queues them now (the admission count must include them before the next
    request is checked); :meth:`deltas` yields what they produce until all have finished or
    the client has gone. ``on_overflow(reason)`` is called when more than
    ``max_stream_buffer_chunks`` deltas wait unread (a stream whose client stopped reading).
    """

    def __init__(self, state: ServerState, gen: Generation, raw: Request) -> None:
        self.state = state
        self.gen = gen
        self.raw = raw
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.watcher: asyncio.Task[None] | None = None
        self.max_buffered = state.server_config.max_stream_buffer_chunks
        self.on_overflow: Callable[[str], None] | None = None

    def start(self) -> None:
        gen, admission = self.gen, self.state.admission
        for i in range(len(gen.prompts)):
            admission.enqueue(gen.engine_id(i), gen.priority, gen.tenant)
        self.tasks = [asyncio.create_task(self._produce(i)) for i in range(len(gen.prompts))]
        self.watcher = asyncio.create_task(self._watch_disconnect())

    async def _produce(self, prompt_idx: int) -> None:
        state, gen = self.state, self.gen
        prompt, engine_id = gen.prompts[prompt_idx], gen.engine_id(prompt_idx)
        tracker = RequestTracker(state.metrics, gen.tier, gen.arrival_time, state.clock)
        request = AddRequest(
            engine_id,
            prompt.token_ids,
            gen.params,
            gen.priority,
            gen.arrival_time,
            tenant=gen.tenant,
        )
        reason = "abort"  # unless it finishes or fails
        last_delta: RequestDelta | None = None
        try:
            async for delta in state.engine.generate(request):
                last_delta = delta
                if tracker.on_delta(delta):
                    state.admission.left_queue(engine_id)
                    state.metrics.observe_tenant_queue_time(gen.tenant, tracker.queue_time_s)
                for d in delta.completions:
                    if d.index == 0 and d.finish_reason is not None:
                        reason = d.finish_reason  # a request's reason is its first choice's
                await self.queue.put((prompt_idx, delta))
                if self.on_overflow is not None and self.queue.qsize() > self.max_buffered:
                    self.on_overflow(f"left more than {self.max_buffered} chunks unread")
        except Exception as e:
            if not isinstance(e, RequestAbortedError):
                reason = "error"
            await self.queue.put((prompt_idx, e))
        finally:
            state.admission.left_queue(engine_id, started=False)
            tracker.finish(reason)
            if state.telemetry is not None:
                state.telemetry.record_sequence(
                    engine_id,
                    gen.request_id,
                    gen.tenant,
                    len(prompt.token_ids),
                    gen.params.max_tokens,
                    tracker,
                    last_delta,
                    reason,
                )

    async def _watch_disconnect(self) -> None:
        while (await self.raw.receive())["type"] != "http.disconnect":
            pass
        for task in self.tasks:  # abort the engine requests now, read or not
            task.cancel()
        await self.queue.put(_DISCONNECTED)

    async def deltas(self) -> AsyncGenerator[list[tuple[int, CompletionDelta]], None]:
        """Each engine delta as it comes, folded into the choices first, as (choice index,
        completion delta) pairs; ends when all finished or the client disconnected.

        Raises:
            APIError: the engine failed one of the requests (in a stream: an error event).
        """
        gen = self.gen
        pending = set(range(len(gen.prompts)))
        try:
            while pending:
                item = await self.queue.get()
                if item is _DISCONNECTED:
                    gen.disconnected = True
                    return
                prompt_idx, delta = item
                if isinstance(delta, BaseException):
                    raise engine_error(delta)
                if delta.finished:
                    pending.discard(prompt_idx)
                yield gen.record(prompt_idx, delta)
        finally:
            # Disconnected, another prompt failed, or the reader left: abort what still runs.
            tasks = [*self.tasks, self.watcher]
            for task in tasks:
                if task is not None:
                    task.cancel()
            await asyncio.gather(*[t for t in tasks if t is not None], return_exceptions=True)


ENGINE_UNAVAILABLE_RETRY_AFTER_S = 1  # the Retry-After of a dead or stopping engine's 503


def bad_request(e: InvalidRequestError) -> APIError:
    return APIError(400, str(e), param=e.param)


def engine_error(e: BaseException) -> BaseException:
    """The API error for an engine-side failure of a request."""
    if isinstance(e, InvalidRequestError):
        return bad_request(e)
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the engine failed this request: {e}", type="internal_error")
    # 503s say when to retry, as admission's do: a dead replica exits within seconds (its pod
    # restarts; a router or client retries elsewhere), a drain's abort is as short-lived.
    retry = {"Retry-After": str(ENGINE_UNAVAILABLE_RETRY_AFTER_S)}
    if isinstance(e, RequestAbortedError):
        return APIError(
            503, f"request aborted: {e}", "service_unavailable_error", code="aborted", headers=retry
        )
    if isinstance(e, EngineDeadError):
        return APIError(
            503, f"the engine is unavailable: {e}", "service_unavailable_error", headers=retry
        )
    return e
