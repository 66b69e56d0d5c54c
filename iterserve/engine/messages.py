"""Everything that crosses the boundary between an engine client and the engine loop.

The engine loop (:class:`~iterserve.engine.engine_core.EngineCore` over an ``LLMEngine``) runs
in its own process or on a thread; its clients (the HTTP server, simulated replicas, tests)
talk to it only through these frozen messages, pickled across the process boundary::

    client                                       engine loop
      AddRequest / AbortRequests ------------->    applied at the next iteration boundary
      UpdateSchedulerConfig / QueryLoad ------>    answered by a CallResult
      Shutdown ------------------------------->    aborts everything, ends the loop
                 <---------------------------- EngineReady (once, after start-up)
                 <---------------------------- StepResult per iteration: RequestDeltas,
                                               telemetry, load, failed requests

Outputs are deltas, as vLLM v1's engine-core outputs are: each :class:`RequestDelta` carries
only the tokens, text and logprobs that are new since the previous one, so the bytes sent per
output token stay constant however long the output grows. The client keeps what a
non-streamed answer needs (:class:`~iterserve.engine.outputs.OutputAccumulator`).

Requests are validated once, by the client, against :class:`RequestLimits` (sent in
:class:`EngineReady`); the engine re-checks only what it alone knows (request ids in use).
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from iterserve.config import EngineConfig, SchedulerConfig
from iterserve.engine.limits import RequestLimits
from iterserve.engine.request import DEFAULT_TENANT
from iterserve.engine.sampling_params import SamplingParams

Clock = Callable[[], float]
"""Seconds from an arbitrary origin, never decreasing. The engine takes its clock as a
parameter (the simulator runs it in virtual time); the default is the system-wide monotonic
clock, which the HTTP process and the engine process share on Linux."""

monotonic_clock: Clock = time.monotonic

_FIELD_GETTERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


class _Positional:
    """Pickles as its class and field values, without field names: the messages sent every
    iteration take about a third fewer bytes and half the time of a slotted dataclass's
    default pickling (``python -m benchmarks.messages``). For dataclasses of two or more fields."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        cls = type(self)
        getter = _FIELD_GETTERS.get(cls)
        if getter is None:
            names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
            getter = _FIELD_GETTERS[cls] = operator.attrgetter(*names)
        return cls, getter(self)


# ----------------------------------------------------------------- errors


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, crashed, or failed to start)."""


class EngineStartError(EngineDeadError):
    """The engine process could not build its engine (it sent :class:`EngineStartFailed`).

    Attributes:
        bad_settings: the error was a :class:`~iterserve.config.ConfigError` (settings the
            model does not take, a model that is not there): the user's to fix, exit 2.
    """

    def __init__(self, message: str, bad_settings: bool) -> None:
        super().__init__(message)
        self.bad_settings = bad_settings


class RequestFailedError(RuntimeError):
    """The iteration that carried this request raised; the request was aborted."""


class RequestAbortedError(RuntimeError):
    """The server aborted this request (for example when its shutdown grace period ended)."""


# ----------------------------------------------------------------- state


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the ``logprobs`` most likely alternatives
    (raw model distribution, natural log)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineLoad(_Positional):
    """Queue and pool counts after an iteration (``/load`` and the queue gauges).

    ``num_running``/``num_waiting``/``num_swapped`` count sequences (a request with ``n = 4``
    counts 4); blocks are KV blocks of the device pool.
    """

    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_total_blocks: int = 0


@dataclass(frozen=True, slots=True)
class IterationStats(_Positional):
    """One iteration, as recorded for metrics (times in seconds of the engine's clock)."""

    time: float  # at its end
    latency_s: float  # schedule + forward + update
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_preemptions: int
    num_swap_preemptions: int = 0  # of num_preemptions, those that swapped
    num_generated_tokens: int = 0  # tokens sampled
    num_prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    num_prefix_cache_hits: int = 0  # of those, tokens found cached
    num_priority_preemptions: int = 0  # of num_preemptions, those for a more urgent request
    num_priority_swap_preemptions: int = 0  # of num_priority_preemptions, those that swapped
    num_scheduled_seqs: int = 0  # sequences in the iteration's batch


# ----------------------------------------------------------------- client -> engine


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a validated request: ``params.n`` completions of one prompt.

    Attributes:
        request_id: unique among the engine's live requests.
        prompt_token_ids: the prompt (token ids below the vocabulary size).
        params: validated sampling parameters.
        priority: resolved integer priority (lower is more urgent).
        arrival_time: when the request was accepted (the client's clock, seconds); queue time
            and aging count from here.
        prompt: the prompt text, kept for offline outputs (None over HTTP: the server keeps
            its own).
        tenant: who sent it; the scheduler shares each tier fairly between tenants.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    prompt: str | None = None
    tenant: str = DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """End these requests at the next iteration boundary, freeing their KV blocks (unknown
    ids are ignored: the request may have finished meanwhile)."""

    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class UpdateSchedulerConfig:
    """Swap in new scheduler settings between iterations; answered once applied."""

    call_id: int
    config: SchedulerConfig


@dataclass(frozen=True, slots=True)
class QueryLoad:
    """Ask for the counts now; answered by a :class:`CallResult` holding an ``EngineLoad``."""

    call_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort every request and end the engine loop."""


EngineCommand = AddRequest | AbortRequests | UpdateSchedulerConfig | QueryLoad | Shutdown

# ----------------------------------------------------------------- engine -> client


@dataclass(frozen=True, slots=True)
class CompletionDelta(_Positional):
    """What is new in one completion of a request since its previous delta.

    Attributes:
        index: the completion's index (0 .. n-1).
        new_token_ids: tokens sampled since the previous delta.
        new_text: text that became visible (may lag the tokens: a multi-byte character split
            across tokens, or a tail that might still begin a stop string, is held back).
        new_logprobs: one entry per new token when the request asked for logprobs, else None.
        finish_reason: ``stop`` / ``length`` / ``abort`` once finished, else None.
        stop_reason: the stop string or stop token id that ended it (None for EOS or length).
    """

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(frozen=True, slots=True)
class RequestDelta(_Positional):
    """One iteration's news of a request: only its completions that changed.

    Attributes:
        request_id: the request's id (as given in :class:`AddRequest`).
        completions: deltas of the completions that advanced or finished.
        finished: every completion of the request has finished (its last delta).
        num_cached_tokens: prompt tokens found in the prefix cache at first admission.
        first_scheduled_time: when first admitted (engine clock, seconds), None before.
        num_preemptions, num_computed_tokens, num_kv_blocks: summed over the completions, set
            on the last delta only (0 before): preemptions, computed tokens, and the KV blocks
            those tokens filled (``ceil(num_computed_tokens / block_size)`` each).
    """

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    num_computed_tokens: int = 0
    num_kv_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request the engine ended with an error (``InvalidRequestError`` for an add the
    engine refused, ``RequestFailedError`` when its iteration raised)."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class StepResult(_Positional):
    """What one iteration (or a batch of commands on an idle engine) changed.

    ``telemetry`` holds the iterations since the previous message (usually one); ``load`` is
    the state after them.
    """

    outputs: list[RequestDelta]
    load: EngineLoad
    telemetry: list[IterationStats] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    num_telemetry_dropped: int = 0  # scheduler_iterations rows the engine dropped, in all
    num_kv_events_dropped: int = 0  # KV-event batches the engine's publisher dropped, in all


@dataclass(frozen=True, slots=True)
class CallResult:
    """The answer to an :class:`UpdateSchedulerConfig` or :class:`QueryLoad`."""

    call_id: int
    value: Any = None
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class EngineReady:
    """Sent once the model is loaded: the engine's settings (``max_model_len`` resolved),
    what requests are validated against, where the model (and its tokenizer) came from, and
    the initial counts."""

    config: EngineConfig
    limits: RequestLimits
    model_dir: str | None
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class EngineStartFailed:
    """Sent instead of :class:`EngineReady` when building the engine raised; the process then
    exits. ``error``: the message of a ``ConfigError`` (``bad_settings``), else the
    exception's type and message."""

    error: str
    bad_settings: bool


EngineMessage = StepResult | CallResult | EngineReady | EngineStartFailed

# ----------------------------------------------------------------- the client seen by the server

IterationCallback = Callable[[list[IterationStats], EngineLoad], None]


class EngineClient(Protocol):
    """What the HTTP server (and anything else that serves requests) needs of an engine.

    Implemented by :class:`~iterserve.engine.process_engine.ProcessEngine` (the engine loop in
    a child process), :class:`~iterserve.engine.async_engine.AsyncEngine` (on a thread of
    this process) and the tests' fake clients. ``config``, ``limits``, ``model_dir`` and
    ``load`` are valid once :meth:`start` has returned; ``limits.scheduler`` follows live
    settings.
    """

    config: EngineConfig
    limits: RequestLimits
    model_dir: str | None
    load: EngineLoad
    on_iteration: IterationCallback | None

    @property
    def is_running(self) -> bool: ...

    async def start(self) -> None:
        """Start the engine loop and wait until it is ready.

        Raises:
            EngineDeadError: it failed to start.
        """

    async def stop(self) -> None:
        """Abort what runs and stop the loop (a no-op when it is gone)."""

    def generate(self, request: AddRequest) -> AsyncIterator[RequestDelta]:
        """Queue a validated request; yield its deltas until the finished one.

        Leaving the iteration early (a client disconnect cancels the task) aborts the request;
        its blocks are free after the engine's next iteration boundary.

        Raises:
            EngineDeadError: the engine is not running (or stops meanwhile).
            RequestFailedError: an iteration carrying the request failed.
            RequestAbortedError: :meth:`abort_all` ended it.
            InvalidRequestError: the engine refused it.
            ValueError: the request id is in use.
        """
        ...

    def abort_all(self, reason: str) -> int:
        """End every stream now with :class:`RequestAbortedError` and abort its request;
        the number of requests aborted."""
        ...

    async def update_scheduler_config(self, config: SchedulerConfig) -> None:
        """Apply new scheduler settings at the next iteration boundary; returns once applied
        (``limits.scheduler`` is the new config from then on).

        Raises:
            EngineDeadError: the engine is not running.
        """
