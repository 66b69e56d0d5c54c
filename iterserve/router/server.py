"""``iterserve router``: discovery, the replica pool's polling and the proxy app under
uvicorn, with a drain on SIGTERM (:mod:`iterserve.draining`): ``/ready`` turns 503 so the
router's own Service stops sending to it, proxied requests keep being served, and the router
exits once none is open or ``--shutdown-grace-period-s`` is over."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp
import uvicorn

from iterserve.draining import DrainingServer
from iterserve.router.app import Background, RouterApp, build_router_app
from iterserve.router.config import RouterConfig
from iterserve.router.pool import ReplicaPool, aiohttp_fetch, polling
from iterserve.router.proxy import KEEPALIVE_S
from iterserve.router.scoring import Picker

if TYPE_CHECKING:  # the kubernetes client and zmq are imported only when used
    from iterserve.router.discovery import EndpointSliceDiscovery
    from iterserve.router.kv_subscriber import KvEventsSubscriber

logger = logging.getLogger("iterserve.router")


def build(args: argparse.Namespace) -> RouterApp:
    """The router's app from its flags.

    Raises:
        ValueError: inconsistent flags, or ``--k8s-service`` without a Kubernetes
            configuration.
    """
    config = RouterConfig.from_args(args)
    pool = ReplicaPool(
        backend_type=config.backend_type,
        poll_interval_s=config.poll_interval_ms / 1000,
        poll_timeout_s=config.poll_timeout_ms / 1000,
        eject_after=config.eject_after,
        api_key=config.backend_api_key,
    )
    picker = Picker(
        config.policy, config.prefix_affinity, stale_after_s=config.stale_after_ms / 1000
    )
    kv_events = _kv_events(config, pool, picker)
    discovery = None
    if config.backend:
        pool.set_urls(list(config.backend))
    else:
        discovery = _discovery(config)
    return build_router_app(pool, picker, config, _background(config, pool, discovery, kv_events))


def _discovery(config: RouterConfig) -> EndpointSliceDiscovery:
    from iterserve.router.discovery import EndpointSliceDiscovery, load_api_client

    assert config.k8s_service is not None
    try:
        api_client = load_api_client()  # fail at start, not silently later
    except Exception as e:
        raise ValueError(f"--k8s-service: no Kubernetes configuration ({e})") from e
    return EndpointSliceDiscovery(
        config.k8s_service, config.namespace, config.k8s_port_name, api_client=api_client
    )


def _kv_events(
    config: RouterConfig, pool: ReplicaPool, picker: Picker
) -> KvEventsSubscriber | None:
    """With ``--kv-events-port``: the picker's KV index and tokenizer, and the subscriptions
    that feed the index (docs/router.md, "KV events").

    Raises:
        ValueError: the tokenizer cannot be loaded.
    """
    if not config.kv_events_port:
        return None
    from iterserve.router.kv_index import KvIndex
    from iterserve.router.kv_subscriber import KvEventsSubscriber
    from iterserve.router.prompt_tokens import load_prompt_tokenizer, prompt_token_ids

    tokenizer = load_prompt_tokenizer(config.tokenizer)
    picker.kv_index = KvIndex()
    picker.tokenize = lambda body: prompt_token_ids(tokenizer, body)
    return KvEventsSubscriber(pool, picker.kv_index, config.kv_events_port)


def _background(
    config: RouterConfig,
    pool: ReplicaPool,
    discovery: EndpointSliceDiscovery | None,
    kv_events: KvEventsSubscriber | None = None,
) -> Background:
    """What runs for the router's lifetime: discovery (if any) feeding the pool, the pool's
    polling over its own aiohttp session, and the KV-event subscriptions (if any)."""

    @contextlib.asynccontextmanager
    async def background() -> AsyncIterator[None]:
        tasks = []
        if discovery is not None:
            from iterserve.router.discovery import replicas_by_name

            on_change = lambda endpoints: pool.set_replicas(replicas_by_name(endpoints))  # noqa: E731
            tasks.append(asyncio.create_task(discovery.run(on_change)))
        if kv_events is not None:
            tasks.append(asyncio.create_task(kv_events.run()))
        timeout = aiohttp.ClientTimeout(total=config.poll_timeout_ms / 1000)
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

    return background


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
    settings = app.proxy.config
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,  # after the drain: then open requests are cut
    )
    server = DrainingRouter(config, app, settings.shutdown_grace_period_s)
    server.run()
    return 0 if server.started else 1
