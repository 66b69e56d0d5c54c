"""``iterserve serve``: uvicorn around :func:`~iterserve.server.app.build_app`, with a
graceful drain on SIGTERM.

The first SIGTERM (or Ctrl-C) does not close the listener (:mod:`iterserve.draining`):
``/ready`` turns 503, new generation requests get 503 with ``Retry-After``, and the server
exits (code 0) once the running requests have finished or the grace period is over. A second
signal exits at once.

An engine that dies while serving (its process killed, its loop crashed) is not recovered in
place: every open stream has already ended with an error event, new requests get 503 and
``/health`` fails, and after :data:`ENGINE_DEAD_EXIT_S` the server exits with code 1, so that
Kubernetes (or systemd) starts a fresh replica.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from iterserve.config import ConfigError, EngineConfig, ServerConfig
from iterserve.draining import DrainingServer
from iterserve.engine.process_engine import LOG_FORMAT, ProcessEngine
from iterserve.kv_events import KVEventsConfig, default_pod_name, make_topic
from iterserve.server.app import build_app
from iterserve.server.state import ServerState, served_model_name

logger = logging.getLogger("iterserve.server")

# After the engine died: how long the server still answers (503 to new requests, the open
# streams' error events, a failing /health a router or a probe can see) before it exits.
ENGINE_DEAD_EXIT_S = 3.0


class GracefulServer(DrainingServer):
    """The replica's drain: new generation requests get 503, the engine's requests finish,
    and after the grace period the engine aborts what still runs."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_period_s: float) -> None:
        super().__init__(config, grace_period_s)
        self.app = app
        self.engine_died_at: float | None = None  # monotonic seconds

    @property
    def exit_code(self) -> int:
        """0 after a clean stop; 1 when start-up failed or the engine died."""
        return 0 if self.started and self.engine_died_at is None else 1

    def _state(self) -> ServerState | None:
        return getattr(self.app.state, "server", None)

    def begin_drain(self) -> bool:
        state = self._state()
        if state is None:
            return False
        state.admission.draining = True
        return True

    def num_active(self) -> int:
        state = self._state()
        return state.num_active if state is not None else 0

    def abort_active(self) -> int:
        state = self._state()
        if state is None:
            return 0
        return state.engine.abort_all("the server's shutdown grace period is over")

    async def on_tick(self, counter: int) -> bool:
        state = self._state()
        now = time.monotonic()
        if self.engine_died_at is None:
            if state is not None and not self.should_exit and not state.engine.is_running:
                logger.error(
                    "the engine is not running; the server exits in %.0f s (exit code 1)",
                    ENGINE_DEAD_EXIT_S,
                )
                self.engine_died_at = now
        elif now > self.engine_died_at + ENGINE_DEAD_EXIT_S:
            self.should_exit = True
        return await super().on_tick(counter)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


def serve(engine_kwargs: dict[str, Any], server_config: ServerConfig) -> int:
    """Run a replica (the engine in its own process) until it is stopped; the exit code.

    Raises:
        ConfigError, TypeError: invalid engine or server settings (some found only when the
            engine process reads the model: the server then stops without serving).
    """
    setup_logging()
    # Invalid settings fail here, before any process starts.
    config = EngineConfig.from_kwargs(**engine_kwargs)
    if server_config.telemetry_db:
        check_telemetry_db(server_config.telemetry_db)
    engine = ProcessEngine(
        engine_kwargs,
        telemetry_db=server_config.telemetry_db,
        hang_timeout_s=server_config.engine_hang_timeout_s,
        kv_events=kv_events_config(server_config, served_model_name(config)),
    )
    return run_server(build_app(engine, server_config), server_config)


def kv_events_config(server_config: ServerConfig, model_name: str) -> KVEventsConfig | None:
    """Where the replica publishes KV-cache events: ``--kv-events-port`` on ``--host`` (by
    default every interface; a pod bound to its own IP publishes on that IP), topic
    ``kv@<pod>@<model>`` (pod: env ``POD_NAME``, else the host name); None when the port is 0."""
    if not server_config.kv_events_port:
        return None
    topic = make_topic(default_pod_name(), model_name)
    return KVEventsConfig(server_config.kv_events_port, topic, server_config.host)


def check_telemetry_db(path: str) -> None:
    """Open (or create) the ``--telemetry-db`` file here, before the model loads, so that a
    bad path fails at once and names the file (the engine process opens it again).

    Raises:
        ConfigError: not a database this version can write (a directory, an unwritable path,
            a corrupt file, another version's tables).
    """
    from iterserve.telemetry.schema import connect

    try:
        connect(path).close()
    except sqlite3.Error as e:
        raise ConfigError(f"--telemetry-db {path}: {e}") from e


def _bad_settings_traceback_filter(app: FastAPI) -> Callable[[logging.LogRecord], bool]:
    """A filter dropping uvicorn's log of the lifespan traceback when the engine refused the
    settings: the CLI says it in one line (a traceback there read as a crash)."""

    def keep(record: logging.LogRecord) -> bool:
        error = getattr(app.state, "start_error", None)
        return not (
            error is not None
            and error.bad_settings
            and record.getMessage().startswith("Traceback (most recent call last)")
        )

    return keep


def listeners(config: uvicorn.Config, server_config: ServerConfig) -> list[socket.socket] | None:
    """The sockets of the replica: ``--port`` and, with ``--admin-port``, the admin listener
    on the same host (one server, one event loop; the middleware tells them apart by the
    local port of each connection). None without an admin port: uvicorn binds its own.

    Raises:
        SystemExit: a port cannot be bound (uvicorn's own exit, logged).
    """
    if server_config.admin_port is None:
        return None
    admin = uvicorn.Config(config.app, host=server_config.host, port=server_config.admin_port)
    return [config.bind_socket(), admin.bind_socket()]


def run_server(app: FastAPI, server_config: ServerConfig) -> int:
    """Serve ``app`` (from :func:`~iterserve.server.app.build_app`) with a graceful drain
    until it is stopped; the exit code."""
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        access_log=False,  # ServerMiddleware writes structured access logs
        log_config=None,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = GracefulServer(config, app, server_config.shutdown_grace_period_s)
    uvicorn_log = logging.getLogger("uvicorn.error")
    keep = _bad_settings_traceback_filter(app)
    uvicorn_log.addFilter(keep)
    try:
        with contextlib.suppress(SystemExit):  # uvicorn's exit(3) when the start-up raised
            server.run(sockets=listeners(config, server_config))
    finally:
        uvicorn_log.removeFilter(keep)
    start_error = getattr(app.state, "start_error", None)
    if start_error is not None and start_error.bad_settings:
        # Settings the model does not take (found only once the engine process read the
        # model, e.g. a tensor-parallel degree): the CLI's one-line error and exit 2.
        raise ConfigError(str(start_error))
    return server.exit_code
