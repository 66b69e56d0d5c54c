"""The router's ASGI app: the proxied paths (``/v1/*``, ``/tokenize``, ``/detokenize``) to
the :class:`~iterserve.router.proxy.Proxy`, the rest to the control app
(:mod:`iterserve.router.control`, which also runs the lifespan). In ``endpoint-picker`` mode
the lifespan runs the ext_proc gRPC server (:class:`~iterserve.router.epp.EndpointPicker`,
over the proxy's decision core) and the HTTP port serves the control app alone."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from iterserve.router.asgi import Receive, Scope, Send
from iterserve.router.config import RouterConfig
from iterserve.router.control import build_control_app
from iterserve.router.epp import EndpointPicker
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import ReplicaPool
from iterserve.router.proxy import Proxy
from iterserve.router.scoring import Picker

Background = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


class RouterApp:
    """The router's ASGI app. ``state`` is the control app's; ``num_active`` counts the
    proxied requests being answered (the drain waits for 0); :meth:`abort_active` ends them
    when the drain is over."""

    def __init__(self, control: FastAPI, proxy: Proxy, picker: EndpointPicker | None) -> None:
        self.control = control
        self.proxy = proxy
        self.picker = picker
        self._num_proxied = 0

    @property
    def num_active(self) -> int:
        """Requests being answered: proxied ones, or the picker's open streams."""
        return self._num_proxied + (len(self.picker.streams) if self.picker else 0)

    def abort_active(self) -> int:
        """:meth:`Proxy.abort_active` (and the picker's): how many requests were open."""
        return self.proxy.abort_active() + (self.picker.abort_active() if self.picker else 0)

    @property
    def state(self) -> Any:
        return self.control.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.picker is None and _proxied(scope["path"]):
            self._num_proxied += 1
            try:
                await self.proxy(scope, receive, send)
            finally:
                self._num_proxied -= 1
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
    """The router's app over ``pool``: a proxy picking with ``picker`` (in ``endpoint-picker``
    mode, the ext_proc server over the same core), the control app, and a lifespan that opens
    the proxy's upstream session (or the gRPC server) and enters ``background`` (the pool's
    polling, discovery) for the app's lifetime."""
    metrics = RouterMetrics()
    pool.on_eject = lambda name: metrics.ejections.labels(replica=name).inc()
    pool.on_remove = metrics.forget_replica
    if picker.kv_index is not None:
        metrics.watch_kv_index(picker.kv_index)
    proxy = Proxy(pool, picker, config, metrics)
    epp = EndpointPicker(proxy.decider) if config.mode == "endpoint-picker" else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if epp is None:
                app.state.router["http"] = await stack.enter_async_context(proxy.connected())
            if background is not None:
                await stack.enter_async_context(background())
            if epp is not None:  # after the polling's first round: picks from the start
                await stack.enter_async_context(epp.serving(config.host, config.grpc_port))
            yield

    return RouterApp(build_control_app(pool, metrics, lifespan), proxy, epp)
