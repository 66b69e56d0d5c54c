"""The asyncio client of the engine: one output stream per request, the loop on its own thread.

The engine loop runs on a dedicated thread: torch releases the GIL inside its kernels, so the
event loop (HTTP, SSE) runs while the forward computes, and an iteration never waits for HTTP
work longer than one Python callback. Commands from the event loop (add, abort, new scheduler
settings) are queued and applied by the engine thread at the next iteration boundary; the
outputs of an iteration are handed back to the event loop in one callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from iterserve.engine.llm_engine import IterationError, LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or failed to start)."""


class RequestFailedError(RuntimeError):
    """The iteration that carried this request raised; the request was aborted."""


class RequestAbortedError(RuntimeError):
    """The server aborted this request (for example when its shutdown grace period ended)."""


async def read_stream(
    stream: asyncio.Queue[RequestOutput | BaseException],
    cleanup: Callable[[bool], None],
    request_id: str | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Yield a request's outputs from its queue until the finished one; raise a queued error.

    ``cleanup(finished)`` runs however the reader leaves (finished, error, or an early exit
    such as a client disconnect, where the caller aborts the request). ``request_id``, when
    given, replaces the id on each output (clients that run requests under internal ids).
    """
    finished = False
    try:
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            if request_id is not None:
                item.request_id = request_id
            yield item
            if finished:
                return
    finally:
        cleanup(finished)


@dataclass
class _Call:
    """A function to run on the engine thread between iterations, with its result future."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any] | None  # None: nobody waits for the result (aborts)


class AsyncEngine:
    """Runs an :class:`LLMEngine` on a background thread for an asyncio application.

    Args:
        engine: the engine; from now on only the engine thread touches it (except the
            read-only ``validate`` and ``resolve_priority`` and the telemetry deque).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Held while queueing a command and while the loop closes, so that no command is
        # queued after the final drain (it would never be answered).
        self._submit_lock = threading.Lock()
        self._closed = False
        self.errored: BaseException | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread after the current iteration (pending requests are aborted)."""
        self._stop.set()
        with self._submit_lock:
            if not self._closed:
                self._commands.put(_Call(lambda: None, None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------- API

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int | str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its output after every iteration that changes it.

        Validation happens before the first yield (``InvalidRequestError`` propagates at
        once). Leaving the iteration early (a client disconnect cancels the task) aborts the
        request; its blocks are free after the next iteration boundary.

        Raises:
            InvalidRequestError: the request can never be served.
            EngineDeadError: the engine loop is not running.
            RequestFailedError: an iteration carrying this request failed.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        self.engine.validate(prompt_token_ids, params)
        resolved = self.engine.resolve_priority(priority)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        added = False
        try:
            await self.call(
                lambda: self.engine.add_request(
                    request_id, prompt_token_ids, params, prompt, priority=resolved
                )
            )
            added = True
        finally:
            if not added:
                self._streams.pop(request_id, None)

        def cleanup(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

        # aclosing: an early exit here (a disconnect) closes the reader at once, which aborts.
        async with contextlib.aclosing(read_stream(stream, cleanup)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort a request at the next iteration boundary (no-op if it already ended)."""
        if self._loop is None:
            return
        call = _Call(lambda: self.engine.abort_request(request_id), None)
        with self._submit_lock:
            if not self._closed:
                self._commands.put(call)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread at the next iteration boundary; return its result.

        Raises:
            EngineDeadError: the loop is not running (or stops before running ``fn``).
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._submit_lock:
            if self._closed or not self.is_running:
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(_Call(fn, future))
        return await future

    # ----------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                self._apply_commands(block)
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # the loop itself broke: fail every stream
            logger.exception("engine loop died")
            self.errored = e
            self._deliver_error(list(self._streams), EngineDeadError(f"engine loop died: {e}"))
            raise
        finally:
            with self._submit_lock:
                self._closed = True
            while True:  # answer every command that will never run
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._resolve(command.future, None, EngineDeadError("the engine stopped"))
            self.engine.abort_all()
            self._deliver_error(list(self._streams), EngineDeadError("the engine stopped"))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._run_call(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_call(self, command: _Call) -> None:
        try:
            result = command.fn()
        except Exception as e:  # user errors go back to the caller, never kill the loop
            self._resolve(command.future, None, e)
        else:
            self._resolve(command.future, result, None)

    def _resolve(
        self, future: asyncio.Future[Any] | None, result: Any, error: BaseException | None
    ) -> None:
        if future is None:
            if error is not None and not isinstance(error, EngineDeadError):
                logger.warning("engine command failed: %s", error)
            return

        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            self._loop.call_soon_threadsafe(settle)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except IterationError as e:
            # One bad iteration must not kill the server: only the requests it carried fail
            # (the engine has aborted them already).
            logger.exception("iteration failed; its requests were aborted")
            self._deliver_error(e.request_ids, RequestFailedError(str(e)))
            return
        if outputs:
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _deliver_error(self, request_ids: list[str], error: BaseException) -> None:
        if self._loop is None:
            return

        def deliver() -> None:
            for request_id in request_ids:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait(error)

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(deliver)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: route one iteration's outputs to their streams."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
