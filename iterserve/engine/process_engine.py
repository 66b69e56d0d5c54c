"""The engine loop in its own process (vLLM v1's design), for an asyncio application.

The child builds the engine with a factory named by ``"module:function"`` (so this module
imports no torch) and runs :class:`~iterserve.engine.engine_core.EngineCore`; commands go down
one pipe, each step's result comes back pickled on another, read by a thread that hands it to
the event loop. Measured faster than the thread on the development machine (``python -m
benchmarks.engine_loop``): the engine's Python work does not share the GIL with the HTTP handlers.

Either side may die without warning (SIGKILL, the OOM killer, a segfault). The child dying ends
every stream with :class:`~iterserve.engine.messages.EngineDeadError` (its pipe's EOF) and
``is_running`` turns False, which the server acts on (:mod:`iterserve.server.launch`). The
parent dying kills the child: on Linux the kernel sends it SIGKILL (``PR_SET_PDEATHSIG``, so
even a child in a long forward or still loading its model goes), elsewhere a thread polls for a
new parent; and an idle child shuts down on its command pipe's EOF.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from typing import Any

from iterserve.config import ConfigError
from iterserve.engine.client import EngineClientBase
from iterserve.engine.engine_core import EngineCore
from iterserve.engine.messages import (
    EngineCommand,
    EngineDeadError,
    EngineReady,
    EngineStartError,
    EngineStartFailed,
    QueryLoad,
    Shutdown,
    monotonic_clock,
)
from iterserve.kv_events import KVEventPublisher, KVEventsBindError, KVEventsConfig
from iterserve.telemetry.iterations import IterationRecorder

logger = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

DEFAULT_FACTORY = "iterserve.executor.build:build_llm_engine"
# Seconds of silence after which the engine process counts as hung (ServerConfig's default).
DEFAULT_HANG_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_INTERVAL_S = 0.5  # where the kernel cannot signal a parent's death


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (its parent) dies, however it dies.

    Linux: the kernel sends SIGKILL when the parent thread that started this process exits
    (``ProcessEngine.start`` runs on the server's main thread, which lives as long as the
    server). Elsewhere a daemon thread polls ``os.getppid()``. Either way a parent already gone
    before this call ends the process at once.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:

        def poll() -> None:
            tick = threading.Event()  # never set: a sleep that reads no clock of ours
            while os.getppid() == parent_pid:
                tick.wait(PARENT_POLL_INTERVAL_S)
            os._exit(1)

        threading.Thread(target=poll, name="iterserve-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the kernel was told
        os._exit(1)


def leave_stop_signals_to_parent() -> None:
    """Ignore SIGINT and SIGTERM in this child process. A terminal's Ctrl-C (and a stop sent to
    the whole process group, as systemd's default does) reaches every process of the group: the
    engine died of its KeyboardInterrupt while the server began to drain, and every running
    stream failed. The parent owns the stop: it drains, then shuts this process down over the
    pipe, or kills it (SIGKILL); it dying still ends this one (:func:`die_with_parent`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def describe_exit(exitcode: int | None) -> str:
    """``"killed by SIGKILL"``, ``"exit code 1"``: a process's end for a log line."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _engine_main(
    factory: str,
    kwargs: dict[str, Any],
    commands: Any,
    results: Any,
    telemetry_db: str | None = None,
    parent_pid: int | None = None,
    kv_events: KVEventsConfig | None = None,
) -> None:
    """The child: build the engine, then run the engine loop over the two pipes (writing
    ``scheduler_iterations`` to ``telemetry_db`` and publishing KV-cache events per
    ``kv_events`` when given); it dies with ``parent_pid``."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
        leave_stop_signals_to_parent()
    # A spawned child starts with no logging set up: log as the server does (start-up notes
    # such as the one-time kernel build, warnings such as a fallback to plain torch).
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    module, name = factory.split(":")
    publisher: KVEventPublisher | None = None
    try:
        # Bound before the model loads: a port in use fails in a second, not a minute.
        publisher = kv_events.open() if kv_events is not None else None
        engine = getattr(importlib.import_module(module), name)(**kwargs)
    except Exception as e:
        if publisher is not None:
            publisher.close()
        # Tell the server why, in one line, rather than leave it an EOF to guess from.
        bad_settings = isinstance(e, ConfigError | KVEventsBindError)
        if bad_settings:
            logger.error("the engine cannot start: %s", e)
        else:
            logger.exception("the engine failed to start")
        error = str(e) if bad_settings else f"{type(e).__name__}: {e}"
        results.send(EngineStartFailed(error, bad_settings))
        results.close()
        sys.exit(2 if bad_settings else 1)

    def recv(block: bool) -> EngineCommand | None:
        try:
            return commands.recv() if block or commands.poll() else None
        except (EOFError, OSError):  # the server closed its end (or died): stop
            logger.warning("the server's command pipe closed; the engine process stops")
            return Shutdown()

    recorder = IterationRecorder(telemetry_db) if telemetry_db else None
    try:
        EngineCore(engine, results.send, recorder, publisher).run(recv)
    finally:
        if recorder is not None:
            recorder.close()
        if publisher is not None:
            publisher.close()


class ProcessEngine(EngineClientBase):
    """An :class:`~iterserve.engine.messages.EngineClient` with the engine in a child process.

    Args:
        engine_kwargs: keywords of the factory (for the default: ``LLM``-style config keys).
        factory: ``"module:function"`` returning an ``LLMEngine``; runs in the child.
        telemetry_db: SQLite file the child writes ``scheduler_iterations`` to (None: off).
        kv_events: where the child publishes KV-cache events (None: off). A port it cannot
            bind fails :meth:`start` with ``EngineStartError(bad_settings=True)``.
        hang_timeout_s: the child is declared hung, and killed, when it has sent nothing for
            this long (seconds; 0: never). A running engine sends a message every iteration;
            an idle one is probed with a ``QueryLoad`` after half the timeout (answered at
            once), so only a stopped or deadlocked process, or one iteration longer than the
            timeout, trips it. Its requests then fail as when the process dies.
    """

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        factory: str = DEFAULT_FACTORY,
        telemetry_db: str | None = None,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        super().__init__()
        self.engine_kwargs = engine_kwargs
        self.factory = factory
        self.telemetry_db = telemetry_db
        self.kv_events = kv_events
        self.hang_timeout_s = hang_timeout_s
        self._last_heard = 0.0  # monotonic_clock() of the child's latest message
        self._hung_after_s: float | None = None  # set when the watchdog killed the child
        self._proc: Any = None
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[EngineCommand | None] = queue.SimpleQueue()
        self._dead = True
        self._stopping = False  # stop() was called: the child's exit is expected

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start the child and wait until its model is loaded.

        Raises:
            EngineStartError: building the engine raised in the child (``bad_settings`` for a
                :class:`~iterserve.config.ConfigError`, e.g. a tensor-parallel degree the
                model's heads do not divide by, or a model that is not there).
            EngineDeadError: the child died or said nothing for ``timeout_s``.
        """
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._res_recv, res_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_engine_main,
            args=(
                self.factory,
                self.engine_kwargs,
                cmd_recv,
                res_send,
                self.telemetry_db,
                os.getpid(),
                self.kv_events,
            ),
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
        if isinstance(message, EngineStartFailed):
            await asyncio.to_thread(self._proc.join, 5)
            raise EngineStartError(message.error, message.bad_settings)
        if not isinstance(message, EngineReady):
            self._proc.kill()
            raise EngineDeadError(f"the engine process sent {type(message).__name__} first")
        self._on_message(message)
        self._dead = False
        threading.Thread(target=self._read, name="iterserve-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="iterserve-engine-writer", daemon=True).start()
        if self.hang_timeout_s > 0:
            self._last_heard = monotonic_clock()
            threading.Thread(target=self._watch, name="iterserve-engine-watch", daemon=True).start()

    async def stop(self) -> None:
        """Abort what runs, stop the child and wait for it (a no-op when it is gone)."""
        self._stopping = True
        with contextlib.suppress(EngineDeadError):
            self._submit(Shutdown())
            with self._send_lock:
                self._outbox.put(None)  # then the writer ends
        if self._proc is not None:
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()
                await asyncio.to_thread(self._proc.join, 5)  # reaped: no zombie left

    @property
    def is_running(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before :meth:`start`)."""
        return self._proc.pid if self._proc is not None else None

    # ----------------------------------------------------------------- plumbing

    def _submit(self, command: EngineCommand) -> None:
        """Queue a command for the writer thread (never blocks the event loop: a pipe write
        blocks while the child runs a long iteration and the pipe is full)."""
        with self._send_lock:
            if self._dead:
                raise EngineDeadError("the engine process is not running")
            self._outbox.put(command)

    def _write(self) -> None:
        """Writer thread: commands -> child, until ``None`` or the pipe breaks."""
        while (command := self._outbox.get()) is not None:
            try:
                self._cmd_send.send(command)
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
                self._last_heard = monotonic_clock()
                logger.exception("unreadable message from the engine process")
                continue
            self._last_heard = monotonic_clock()
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                self._loop.call_soon_threadsafe(self._on_message, message)
        with self._send_lock:
            self._dead = True
            self._outbox.put(None)
        error = EngineDeadError("the engine stopped")
        if not self._stopping:
            self._proc.join(1.0)  # its exit code, for the log and the streams' error events
            how = describe_exit(self._proc.exitcode)
            if self._hung_after_s is not None:
                how = f"hung: nothing sent for {self._hung_after_s:.0f} s, then {how}"
            logger.error("the engine process died (%s)", how)
            error = EngineDeadError(f"the engine process died ({how})")
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _watch(self) -> None:
        """Watchdog thread: probe a silent child, kill a hung one (``hang_timeout_s``)."""
        tick = threading.Event()  # never set: a sleep that reads no clock of ours
        probed_at = None
        while not self._dead and not self._stopping:
            tick.wait(min(1.0, self.hang_timeout_s / 4))
            silent_s = monotonic_clock() - self._last_heard
            if silent_s < self.hang_timeout_s / 2:
                probed_at = None
                continue
            if probed_at is None or probed_at < self._last_heard:
                # Idle, or in a long iteration: a load query is answered at the next boundary.
                probed_at = monotonic_clock()
                with contextlib.suppress(EngineDeadError):
                    self._submit(QueryLoad(next(self._call_ids)))  # the answer is ignored
            if silent_s >= self.hang_timeout_s and not self._stopping:
                logger.error(
                    "the engine process sent nothing for %.0f s (hang_timeout_s=%g): killing it",
                    silent_s,
                    self.hang_timeout_s,
                )
                self._hung_after_s = silent_s
                self._proc.kill()  # the reader sees the pipe close: every request fails
                return
