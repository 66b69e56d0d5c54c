"""Helpers for router tests: a router in the test's event loop, polling until."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from iterserve.cli import build_parser
from iterserve.router.server import build


@contextlib.asynccontextmanager
async def router(*flags: str) -> AsyncIterator[tuple[str, Any]]:
    """``iterserve router FLAGS`` in this event loop; (its URL, its app)."""
    args = build_parser().parse_args(["router", "--poll-interval-ms", "20", *flags])
    assert isinstance(args, argparse.Namespace)
    app = build(args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "the router did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        await task
        sock.close()


async def until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def pool_of(app: Any) -> Any:
    return app.state.router["pool"]


def all_idle(app: Any) -> bool:
    """Every replica of the router ``app`` ready, reported idle, nothing of the router's in
    flight: what a test waits for so that the next pick sees fresh loads."""
    states = [b.state for b in pool_of(app).backends.values()]
    return all(
        s.ready and s.report and s.report.num_running + s.report.num_waiting == 0 and s.load == 0
        for s in states
    )
