"""The router's ASGI app: the proxied paths (``/v1/*``, ``/tokenize``, ``/detokenize``) to
the :class:`~iterserve.router.proxy.Proxy`, the rest to the control app
(:mod:`iterserve.router.control`, which also runs the lifespan)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from iterserve.router.asgi import Receive, Scope, Send
from iterserve.router.config import RouterConfig
from iterserve.router.control import build_control_app
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import ReplicaPool
from iterserve.router.proxy import Proxy
from iterserve.router.scoring import Picker

Background = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


class RouterApp:
    """The router's ASGI app. ``state`` is the control app's; ``num_active`` counts the
    proxied requests being answered (the drain waits for 0); :meth:`abort_active` ends them
    when the drain is over."""

    def __init__(self, control: FastAPI, proxy: Proxy) -> None:
        self.control = control
        self.proxy = proxy
        self.num_active = 0

    def abort_active(self) -> int:
        """:meth:`Proxy.abort_active`: how many proxied requests were open."""
        return self.proxy.abort_active()

    @property
    def state(self) -> Any:
        return self.control.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _proxied(scope["path"]):
            self.num_active += 1
            try:
                await self.proxy(scope, receive, send)
            finally:
                self.num_active -= 1
        else:
            await self.control(scope, receive, send)


def _proxied(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def build_router_app(
    pool: ReplicaPool,
    picker: Picker,
    config: RouterConfig,
    background: Background | None = None,
) -> RouterApp:
    """The router's app over ``pool``: a proxy picking with ``picker``, the control app, and
    a lifespan that opens the proxy's upstream session and enters ``background`` (the pool's
    polling, discovery) for the app's lifetime."""
    metrics = RouterMetrics()
    pool.on_eject = lambda name: metrics.ejections.labels(replica=name).inc()
    pool.on_remove = metrics.forget_replica
    proxy = Proxy(pool, picker, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with proxy.connected() as http:
            app.state.router["http"] = http
            async with background() if background else contextlib.nullcontext():
                yield

    return RouterApp(build_control_app(pool, metrics, lifespan), proxy)
