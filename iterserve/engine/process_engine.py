"""The asyncio engine client with the engine loop in its own process (vLLM v1's design).

Same API as :class:`~iterserve.engine.async_engine.AsyncEngine`. The child process builds the
engine with a factory named by ``"module:function"`` (so this module imports no torch) and
runs the loop; commands go down one pipe, each iteration's outputs come back pickled on
another, read by a thread that hands them to the event loop. Requests are validated here,
against the child's :class:`RequestLimits`, before anything is sent. Measured faster than the
thread on the development machine (``iterserve bench engine-loop``): the engine's Python work
no longer shares the GIL with the HTTP handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from iterserve.config import SchedulerConfig
from iterserve.engine.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    read_stream,
)
from iterserve.engine.limits import RequestLimits
from iterserve.engine.llm_engine import IterationError, IterationStats
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

DEFAULT_FACTORY = "iterserve.executor.build:build_llm_engine"


def _engine_main(factory: str, kwargs: dict[str, Any], commands: Any, results: Any) -> None:
    """The child: build the engine, then loop: apply commands, step, send outputs.

    Each iteration's message carries its outputs, the telemetry records since the previous
    message and the queue/pool counts after it; an idle engine that applied commands (an
    abort) sends the counts too, so the parent's view is never stale by more than a message.
    """
    # A spawned child starts with no logging set up: log as the server does (start-up notes
    # such as the one-time kernel build, warnings such as a fallback to plain torch).
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    module, name = factory.split(":")
    engine = getattr(importlib.import_module(module), name)(**kwargs)
    results.send(("ready", engine.limits, engine.model_dir, engine.stats()))
    num_sent = engine.num_iterations
    dirty = False
    while True:
        while commands.poll() or not engine.has_unfinished_requests():
            if dirty and not commands.poll():
                results.send(("state", [], [], engine.stats()))
                dirty = False
            message = commands.recv()
            dirty = True
            kind = message[0]
            if kind == "stop":
                engine.abort_all()
                return
            if kind == "add":
                try:
                    engine.add_request(*message[1])
                except Exception as e:  # validated in the parent; report anything left
                    results.send(("request_error", message[1][0], e))
            elif kind == "abort":
                engine.abort_request(message[1])
            elif kind == "call":
                call_id, method, args = message[1:]
                try:
                    results.send(("result", call_id, True, getattr(engine, method)(*args)))
                except Exception as e:
                    results.send(("result", call_id, False, e))
        try:
            outputs = engine.step()
        except IterationError as e:
            cause = f"{type(e.cause).__name__}: {e.cause}"
            results.send(("failed", e.request_ids, cause))
            continue
        except Exception as e:
            # A bug outside the forward: end every request rather than the engine process.
            logger.exception("engine step failed; aborting every request")
            failed = [o.request_id for o in engine.abort_all()]
            results.send(("failed", failed, f"internal engine error ({type(e).__name__})"))
            continue
        num_new = min(engine.num_iterations - num_sent, len(engine.telemetry))
        num_sent = engine.num_iterations
        telemetry = list(itertools.islice(reversed(engine.telemetry), num_new))[::-1]
        results.send(("outputs", outputs, telemetry, engine.stats()))
        dirty = False


class ProcessEngine:
    """Runs an ``LLMEngine`` in a child process for an asyncio application.

    Args:
        engine_kwargs: keywords of the factory (for the default: ``LLM``-style config keys).
        factory: ``"module:function"`` returning an ``LLMEngine``; runs in the child.
    """

    def __init__(self, engine_kwargs: dict[str, Any], factory: str = DEFAULT_FACTORY) -> None:
        self.engine_kwargs = engine_kwargs
        self.factory = factory
        self.limits: RequestLimits | None = None
        self.model_dir: str | None = None
        # Queue and pool counts as of the child's latest message (LLMEngine.stats()).
        self.state: dict[str, Any] = {}
        # Called on the event loop with each batch of per-iteration telemetry records.
        self.on_iteration: Callable[[list[IterationStats], dict[str, Any]], None] | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._internal_ids = itertools.count()
        self._live_ids: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._dead = True

    # ----------------------------------------------------------------- lifecycle

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start the child and wait until its model is loaded.

        Raises:
            EngineDeadError: the child failed to start.
        """
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._res_recv, res_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_engine_main,
            args=(self.factory, self.engine_kwargs, cmd_recv, res_send),
            name="iterserve-engine-core",
            daemon=True,
        )
        self._proc.start()
        res_send.close()
        cmd_recv.close()
        try:
            message = await asyncio.wait_for(asyncio.to_thread(self._res_recv.recv), timeout_s)
        except (EOFError, OSError, TimeoutError) as e:
            self._proc.kill()
            raise EngineDeadError(f"the engine process failed to start: {e!r}") from e
        assert message[0] == "ready"
        self.limits, self.model_dir, self.state = message[1:]
        self._dead = False
        threading.Thread(target=self._read, name="iterserve-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="iterserve-engine-writer", daemon=True).start()

    async def stop(self) -> None:
        """Abort what runs, stop the child and wait for it (a no-op when it is gone)."""
        with contextlib.suppress(EngineDeadError):
            self._send(("stop",))
            self._send(None)  # then the writer ends
        if self._proc is not None:
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()

    @property
    def is_running(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.is_alive()

    # ----------------------------------------------------------------- API

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int | str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As :meth:`AsyncEngine.generate`.

        In the child the request runs under a unique internal id, so that outputs still in
        flight for an earlier request with the same id never reach this one.
        """
        if not self.is_running or self.limits is None:
            raise EngineDeadError("the engine process is not running")
        self.limits.validate(prompt_token_ids, params)
        resolved = self.limits.resolve_priority(priority)
        if request_id in self._live_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        internal_id = f"{next(self._internal_ids)}:{request_id}"
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[internal_id] = stream
        self._live_ids.add(request_id)
        try:
            self._send(("add", (internal_id, prompt_token_ids, params, prompt, None, resolved)))
        except EngineDeadError:
            self._streams.pop(internal_id, None)
            self._live_ids.discard(request_id)
            raise

        def cleanup(finished: bool) -> None:
            self._streams.pop(internal_id, None)
            self._live_ids.discard(request_id)
            if not finished:
                self.abort(internal_id)

        # aclosing: an early exit here (a disconnect) closes the reader at once, which aborts.
        async with contextlib.aclosing(read_stream(stream, cleanup, request_id)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (by its internal id) at the child's next iteration boundary."""
        with contextlib.suppress(EngineDeadError):
            self._send(("abort", request_id))

    def abort_all(self, reason: str) -> int:
        """End every stream now with :class:`RequestAbortedError` (``reason``) and abort its
        request in the child; the number of requests aborted."""
        for internal_id, stream in list(self._streams.items()):
            stream.put_nowait(RequestAbortedError(reason))
            self.abort(internal_id)
        return len(self._streams)

    async def call(self, method: str, *args: Any) -> Any:
        """Call ``LLMEngine.<method>(*args)`` in the child between iterations; its result.

        Raises:
            EngineDeadError: the child is not running.
        """
        if self._loop is None:
            raise EngineDeadError("the engine process was never started")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, method, args))
        except EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        return await future

    async def update_scheduler_config(self, config: SchedulerConfig) -> None:
        """Apply new scheduler settings at the child's next iteration boundary; returns once
        applied (new requests are validated against them from then on)."""
        await self.call("update_scheduler_config", config)
        if self.limits is not None:
            self.limits = dataclasses.replace(self.limits, scheduler=config)

    # ----------------------------------------------------------------- plumbing

    def _send(self, message: tuple[Any, ...] | None) -> None:
        """Queue a command for the writer thread (never blocks the event loop: a pipe write
        blocks while the child runs a long iteration and the pipe is full)."""
        with self._send_lock:
            if self._dead:
                raise EngineDeadError("the engine process is not running")
            self._outbox.put(message)

    def _write(self) -> None:
        """Writer thread: commands -> child, until ``None`` or the pipe breaks."""
        while (message := self._outbox.get()) is not None:
            try:
                self._cmd_send.send(message)
            except (OSError, EOFError, ValueError):
                with self._send_lock:
                    self._dead = True
                return

    def _read(self) -> None:
        """Reader thread: child messages -> event loop, until the child's pipe closes."""
        assert self._loop is not None
        while True:
            try:
                message = self._res_recv.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that cannot be unpickled: drop it, keep reading
                logger.exception("unreadable message from the engine process")
                continue
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                self._loop.call_soon_threadsafe(self._handle, message)
        with self._send_lock:
            self._dead = True
            self._outbox.put(None)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError("the engine stopped"))

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind in ("outputs", "state"):
            outputs, telemetry, self.state = message[1:]
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
            if self.on_iteration is not None:
                try:
                    self.on_iteration(telemetry, self.state)
                except Exception:
                    logger.exception("on_iteration callback failed")
        elif kind == "failed":
            for request_id in message[1]:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait(RequestFailedError(message[2]))
        elif kind == "request_error":
            stream = self._streams.get(message[1])
            if stream is not None:
                stream.put_nowait(message[2])
        elif kind == "result":
            future = self._calls.pop(message[1], None)
            if future is not None and not future.done():
                if message[2]:
                    future.set_result(message[3])
                else:
                    future.set_exception(message[3])

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
