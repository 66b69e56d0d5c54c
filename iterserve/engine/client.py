"""The client half of the engine boundary, shared by the thread and the process clients.

:class:`EngineClientBase` keeps one asyncio queue per live request and routes each
:class:`~iterserve.engine.messages.StepResult` (delivered on the event loop) to them; calls
(new scheduler settings, a load query) wait on futures answered by ``CallResult`` s. A
subclass only moves commands to the engine loop (``_submit``) and the loop's messages back
(``_on_message`` on the event loop), and starts and stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

from iterserve.config import EngineConfig, SchedulerConfig
from iterserve.engine.limits import RequestLimits
from iterserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    EngineCommand,
    EngineDeadError,
    EngineLoad,
    EngineMessage,
    EngineReady,
    IterationCallback,
    QueryLoad,
    RequestAbortedError,
    RequestDelta,
    StepResult,
    UpdateSchedulerConfig,
)

logger = logging.getLogger(__name__)

_Item = RequestDelta | BaseException


class EngineClientBase:
    """Streams, calls and message routing of an :class:`~iterserve.engine.messages.EngineClient`.

    In the engine each request runs under a unique internal id (``"<k>:<request_id>"``), so
    that deltas still in flight for an earlier request with the same id never reach a new one.
    """

    def __init__(self) -> None:
        # Set by EngineReady (once started).
        self.config: EngineConfig = None  # type: ignore[assignment]
        self.limits: RequestLimits = None  # type: ignore[assignment]
        self.model_dir: str | None = None
        self.load = EngineLoad()
        self.on_iteration: IterationCallback | None = None
        # scheduler_iterations rows the engine's telemetry writer dropped, in all.
        self.num_telemetry_dropped = 0
        # KV-event batches the engine's publisher dropped, in all (--kv-events-port).
        self.num_kv_events_dropped = 0
        self._streams: dict[str, asyncio.Queue[_Item]] = {}  # internal id ->
        self._live: dict[str, str] = {}  # request id -> internal id
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._internal_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None

    # ----------------------------------------------------------------- transport (subclass)

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def _submit(self, command: EngineCommand) -> None:
        """Hand a command to the engine loop without blocking; raise EngineDeadError when it
        is gone."""
        raise NotImplementedError

    # ----------------------------------------------------------------- API

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestDelta]:
        """See :meth:`EngineClient.generate`."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        request_id = request.request_id
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        internal_id = f"{next(self._internal_ids)}:{request_id}"
        stream: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[internal_id] = stream
        self._live[request_id] = internal_id
        finished = False
        try:
            self._submit(dataclasses.replace(request, request_id=internal_id))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield dataclasses.replace(item, request_id=request_id)
        finally:
            # However the reader leaves: finished, an error, or early (a client disconnect,
            # where the request must be aborted now).
            self._streams.pop(internal_id, None)
            if self._live.get(request_id) == internal_id:
                del self._live[request_id]
            if not finished:
                with contextlib.suppress(EngineDeadError):
                    self._submit(AbortRequests([internal_id]))

    def abort_all(self, reason: str) -> int:
        """See :meth:`EngineClient.abort_all`."""
        for stream in self._streams.values():
            stream.put_nowait(RequestAbortedError(reason))
        with contextlib.suppress(EngineDeadError):
            self._submit(AbortRequests(list(self._streams)))
        return len(self._streams)

    async def update_scheduler_config(self, config: SchedulerConfig) -> None:
        """See :meth:`EngineClient.update_scheduler_config`."""
        await self._call(lambda call_id: UpdateSchedulerConfig(call_id, config))
        self.limits = dataclasses.replace(self.limits, scheduler=config)

    async def query_load(self) -> EngineLoad:
        """The engine's counts now (answered between iterations)."""
        load: EngineLoad = await self._call(QueryLoad)
        return load

    async def _call(self, make: Any) -> Any:
        if self._loop is None:
            raise EngineDeadError("the engine was never started")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._submit(make(call_id))
        except EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        return await future

    # ----------------------------------------------------------------- messages (event loop)

    def _on_message(self, message: EngineMessage) -> None:
        if isinstance(message, StepResult):
            self.load = message.load
            self.num_telemetry_dropped = message.num_telemetry_dropped
            self.num_kv_events_dropped = message.num_kv_events_dropped
            for delta in message.outputs:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put_nowait(delta)
            for error in message.errors:
                stream = self._streams.get(error.request_id)
                if stream is not None:
                    stream.put_nowait(error.error)
            if self.on_iteration is not None:
                try:
                    self.on_iteration(message.telemetry, message.load)
                except Exception:
                    logger.exception("on_iteration callback failed")
        elif isinstance(message, CallResult):
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(message.error)
                else:
                    future.set_result(message.value)
        elif isinstance(message, EngineReady):
            self.config, self.limits = message.config, message.limits
            self.model_dir, self.load = message.model_dir, message.load
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)

    def _fail_all(self, error: BaseException) -> None:
        """The engine is gone: end every stream and call with ``error``."""
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
