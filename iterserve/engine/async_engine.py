"""The engine loop on a thread of this process, for an asyncio application.

torch releases the GIL inside its kernels, so the event loop (HTTP, SSE) runs while the forward
computes. Commands from the event loop go to the engine thread through a queue and are applied
at the next iteration boundary; each step's result is handed to the event loop in one
callback. One process per replica: what simulated replicas use (their runner sleeps instead of
computing). The real server defaults to :class:`~iterserve.engine.process_engine.ProcessEngine`
(measured faster, ``python -m benchmarks.engine_loop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading

from iterserve.engine.client import EngineClientBase
from iterserve.engine.engine_core import EngineCore
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.messages import (
    EngineCommand,
    EngineDeadError,
    EngineMessage,
    Shutdown,
)
from iterserve.kv_events import KVEventPublisher
from iterserve.telemetry.iterations import IterationRecorder

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClientBase):
    """An :class:`~iterserve.engine.messages.EngineClient` running ``engine`` on a thread.

    Args:
        engine: the engine; once started only the engine thread touches it.
        telemetry_db: SQLite file the engine thread writes ``scheduler_iterations`` to
            (through its own writer thread; None: off).
        kv_publisher: where the engine thread publishes KV-cache events (None: off); this
            client owns it from now on and closes it when the loop ends.
    """

    def __init__(
        self,
        engine: LLMEngine,
        telemetry_db: str | None = None,
        kv_publisher: KVEventPublisher | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.telemetry_db = telemetry_db
        self.kv_publisher = kv_publisher
        self.config = engine.config
        self.limits = engine.limits
        self.model_dir = engine.model_dir
        self.load = engine.load()
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Held while queueing a command and while the loop closes, so that no command is
        # queued after the loop has gone (it would never be answered).
        self._submit_lock = threading.Lock()
        self._closed = False
        self._recorder: IterationRecorder | None = None

    async def start(self) -> None:
        """Start the engine thread, bound to the running event loop; returns once it runs.

        Raises:
            sqlite3.Error: ``telemetry_db`` cannot be opened.
        """
        if self.telemetry_db:
            self._recorder = IterationRecorder(self.telemetry_db)
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        self._thread.start()
        await self._ready

    async def stop(self) -> None:
        """Stop the engine thread after the current iteration (pending requests are aborted)."""
        with contextlib.suppress(EngineDeadError):
            self._submit(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread is not None and self._thread.is_alive()

    def _submit(self, command: EngineCommand) -> None:
        with self._submit_lock:
            if self._closed or self._thread is None:
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(command)

    # ----------------------------------------------------------------- engine thread

    def _recv(self, block: bool) -> EngineCommand | None:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _send(self, message: EngineMessage) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            self._loop.call_soon_threadsafe(self._on_message, message)

    def _run(self) -> None:
        error: BaseException = EngineDeadError("the engine stopped")
        try:
            EngineCore(self.engine, self._send, self._recorder, self.kv_publisher).run(self._recv)
        except BaseException as e:  # the loop itself broke: fail every stream
            logger.exception("engine loop died")
            error = EngineDeadError(f"engine loop died: {e}")
            raise
        finally:
            with self._submit_lock:
                self._closed = True
            if self._recorder is not None:
                self._recorder.close()
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            self.engine.abort_all()
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fail_all, error)
