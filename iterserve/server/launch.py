"""``iterserve serve``: uvicorn around :func:`~iterserve.server.app.build_app`, with a
graceful drain on SIGTERM.

Kubernetes sends SIGTERM on a rolling update and keeps routing to the pod for a moment. So
the first SIGTERM (or Ctrl-C) does not close the listener: ``/ready`` turns 503, new
generation requests get 503 with ``Retry-After``, and the server exits (code 0) once the
running requests have finished or the grace period is over. A second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from iterserve.config import EngineConfig, ServerConfig, require_single_device
from iterserve.engine.process_engine import LOG_FORMAT, ProcessEngine
from iterserve.server.app import build_app
from iterserve.server.state import ServerState

logger = logging.getLogger("iterserve.server")

# After the grace period, aborted requests get this long to send their last bytes.
ABORT_WAIT_S = 5.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_period_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_period_s = grace_period_s
        self.drain_deadline: float | None = None
        self.aborted = False

    def _state(self) -> ServerState | None:
        return getattr(self.app.state, "server", None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self._state()
        if self.drain_deadline is not None or state is None:
            self.should_exit = True  # second signal, or nothing started yet: exit now
            if sig == signal.SIGINT and self.drain_deadline is not None:
                self.force_exit = True
            return
        self.drain_deadline = time.monotonic() + self.grace_period_s
        state.admission.draining = True
        logger.info(
            "signal %s: draining %d active requests (grace period %.0f s)",
            signal.Signals(sig).name,
            state.num_active,
            self.grace_period_s,
        )

    async def on_tick(self, counter: int) -> bool:
        state = self._state()
        if self.drain_deadline is not None and state is not None and not self.should_exit:
            if state.num_active == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif not self.aborted and time.monotonic() > self.drain_deadline:
                # End what still runs with an error event / 503 rather than cutting streams.
                num = state.engine.abort_all("the server's shutdown grace period is over")
                logger.warning("grace period over: aborted %d requests", num)
                self.aborted = True
            elif self.aborted and time.monotonic() > self.drain_deadline + ABORT_WAIT_S:
                logger.warning("%d requests still open; shutting down", state.num_active)
                self.should_exit = True
        return await super().on_tick(counter)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


def serve(engine_kwargs: dict[str, Any], server_config: ServerConfig) -> int:
    """Run a replica (the engine in its own process) until it is stopped; the exit code.

    Raises:
        ConfigError, TypeError: invalid engine or server settings.
    """
    setup_logging()
    # Invalid settings fail here, before any process starts.
    require_single_device(EngineConfig.from_kwargs(**engine_kwargs))
    return run_server(build_app(ProcessEngine(engine_kwargs), server_config), server_config)


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
    server.run()
    return 0 if server.started else 1
