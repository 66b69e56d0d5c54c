"""``iterserve router``: discovery, the replica pool's polling and the proxy app under
uvicorn, with a drain on SIGTERM (:mod:`iterserve.draining`): ``/ready`` turns 503 so the
router's own Service stops sending to it, proxied requests keep being served, and the router
exits once none is open or ``--shutdown-grace-period-s`` is over."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import sys
import urllib.parse
from collections.abc import AsyncIterator

import aiohttp
import uvicorn

from iterserve import envs
from iterserve.draining import DrainingServer
from iterserve.router.pool import ReplicaPool, aiohttp_fetch, polling
from iterserve.router.proxy import KEEPALIVE_S, ProxySettings, RouterApp, build_router_app
from iterserve.router.scoring import Picker

logger = logging.getLogger("iterserve.router")


def build(args: argparse.Namespace) -> RouterApp:
    """The router's app from its flags.

    Raises:
        ValueError: inconsistent flags.
    """
    if not args.backend and not args.k8s_service:
        raise ValueError("give --backend URL (repeatable) or --k8s-service NAME")
    if args.backend and args.k8s_service:
        raise ValueError("give either --backend or --k8s-service, not both")
    for name in (
        "poll_interval_ms", "poll_timeout_ms", "stale_after_ms", "connect_timeout_s",
        "first_byte_timeout_s", "read_timeout_s", "max_request_body_bytes",
        "shutdown_grace_period_s",
    ):  # fmt: skip
        value = getattr(args, name)
        if not 0 < value < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.poll_timeout_ms >= args.stale_after_ms:
        raise ValueError("--poll-timeout-ms must be below --stale-after-ms")
    for url in args.backend:
        _check_url(url)
    if args.eject_after < 1:
        raise ValueError("--eject-after must be >= 1")
    pool = ReplicaPool(
        backend_type=args.backend_type,
        poll_interval_s=args.poll_interval_ms / 1000,
        poll_timeout_s=args.poll_timeout_ms / 1000,
        eject_after=args.eject_after,
        api_key=args.backend_api_key or envs.ITERSERVE_BACKEND_API_KEY,
    )
    picker = Picker(args.policy, args.prefix_affinity, stale_after_s=args.stale_after_ms / 1000)
    settings = ProxySettings(
        api_key=args.api_key or envs.ITERSERVE_API_KEY,
        backend_api_key=args.backend_api_key or envs.ITERSERVE_BACKEND_API_KEY,
        session_header=args.session_header.lower(),
        connect_timeout_s=args.connect_timeout_s,
        first_byte_timeout_s=args.first_byte_timeout_s,
        read_timeout_s=args.read_timeout_s,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    if args.backend:
        pool.set_urls(list(args.backend))
        discovery = None
    else:
        from iterserve.router.discovery import EndpointSliceDiscovery, load_api_client

        try:
            api_client = load_api_client()  # fail at start, not silently later
        except Exception as e:
            raise ValueError(f"--k8s-service: no Kubernetes configuration ({e})") from e
        discovery = EndpointSliceDiscovery(
            args.k8s_service, args.namespace, args.k8s_port_name, api_client=api_client
        )

    @contextlib.asynccontextmanager
    async def background() -> AsyncIterator[None]:
        tasks = []
        if discovery is not None:
            on_change = lambda endpoints: pool.set_urls([e.url for e in endpoints])  # noqa: E731
            tasks.append(asyncio.create_task(discovery.run(on_change)))
        timeout = aiohttp.ClientTimeout(total=args.poll_timeout_ms / 1000)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            pool.fetch = aiohttp_fetch(http)
            async with polling(pool):
                try:
                    yield
                finally:
                    for task in tasks:
                        task.cancel()
                    for task in tasks:
                        with contextlib.suppress(asyncio.CancelledError):
                            await task

    return build_router_app(pool, picker, settings, background)


def _check_url(url: str) -> None:
    parsed = urllib.parse.urlparse(url)
    try:
        port = parsed.port
    except ValueError as e:
        raise ValueError(f"--backend {url!r}: {e}") from e
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == 0:
        raise ValueError(f"--backend must look like http://host:port, got {url!r}")


class DrainingRouter(DrainingServer):
    """The router's drain: ``/ready`` 503, proxied requests served to their end."""

    def __init__(self, config: uvicorn.Config, app: RouterApp, grace_period_s: float) -> None:
        super().__init__(config, grace_period_s)
        self.app = app

    def begin_drain(self) -> bool:
        self.app.state.draining = True
        return True

    def num_active(self) -> int:
        return self.app.num_active

    def abort_active(self) -> int:
        return self.app.abort_active()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = build(args)
    except ValueError as e:
        print(f"iterserve router: error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,  # after the drain: then open requests are cut
    )
    server = DrainingRouter(config, app, args.shutdown_grace_period_s)
    server.run()
    return 0 if server.started else 1
