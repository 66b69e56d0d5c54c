"""The router's subscriptions to its replicas' KV-cache events (``--kv-events-port``).

One task per replica holds a ZMQ SUB socket (``zmq.asyncio``) connected to
``tcp://<replica host>:PORT`` (the host of its URL, the port the same for all, as the
operator's pods publish on ``--kv-events-port``), subscribed to the ``kv@`` topics, and feeds
every message to the :class:`~iterserve.router.kv_index.KvIndex` under the replica's name.
A socket monitor reports each connect and disconnect, and either clears the replica's blocks
(a replica that restarted, or a connection that lost messages, starts afresh; its next
batches rebuild the index); a disconnected socket is closed and the next reconcile connects a
new one (ZMQ's own reconnect stops after a protocol error, such as a frame over the size
limit). A frame over ``max_message_bytes`` is never buffered: ZMQ drops the connection.
Every ``reconcile_interval_s`` the set of subscriptions follows the pool's replicas: new ones
subscribed, gone ones closed and dropped from the index, one at a new URL subscribed anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from iterserve.kv_events import MAX_PAYLOAD_BYTES
from iterserve.router.kv_index import KvIndex
from iterserve.router.pool import ReplicaPool

logger = logging.getLogger("iterserve.router")

TOPIC_PREFIX = b"kv@"


def events_endpoint(url: str, port: int) -> str:
    """``tcp://host:port`` of the replica at ``url`` (IPv6 hosts bracketed)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KvEventsSubscriber:
    """Subscriptions to every replica of ``pool`` (see the module docstring).

    Args:
        pool: the replicas (their names and URLs).
        index: where the events go.
        port: the replicas' KV-events port.
        reconcile_interval_s: how often the subscriptions follow the pool.
        max_message_bytes: the largest frame received (ZMQ's ``MAXMSGSIZE``); a publisher
            sending a larger one is disconnected (and reconnected, its replica cleared).
    """

    def __init__(
        self,
        pool: ReplicaPool,
        index: KvIndex,
        port: int,
        reconcile_interval_s: float = 0.2,
        max_message_bytes: int = MAX_PAYLOAD_BYTES + 1024,
    ) -> None:
        if not 1 <= port <= 65535:
            raise ValueError(f"--kv-events-port must be in [1, 65535], got {port}")
        self.max_message_bytes = max_message_bytes
        self.pool = pool
        self.index = index
        self.port = port
        self.reconcile_interval_s = reconcile_interval_s
        self.num_connects = 0  # connections made, all replicas (tests and logs)
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}  # name -> (endpoint, task)

    async def run(self) -> None:
        """Follow the pool until cancelled; every socket is closed on the way out."""
        ctx = zmq.asyncio.Context()
        try:
            while True:
                self._reconcile(ctx)
                await asyncio.sleep(self.reconcile_interval_s)
        finally:
            tasks = [task for _, task in self._tasks.values()]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks.clear()
            ctx.destroy(linger=0)

    def _reconcile(self, ctx: zmq.asyncio.Context) -> None:
        wanted = {b.name: events_endpoint(b.url, self.port) for b in self.pool.backends.values()}
        for name, (endpoint, task) in list(self._tasks.items()):
            if wanted.get(name) != endpoint:
                task.cancel()
                del self._tasks[name]
                self.index.remove(name)
            elif task.done():  # disconnected, or a bad endpoint: a new socket, afresh
                del self._tasks[name]
                self.index.clear(name)
        for name, endpoint in wanted.items():
            if name not in self._tasks:
                task = asyncio.create_task(self._subscribe(ctx, name, endpoint))
                self._tasks[name] = (endpoint, task)

    async def _subscribe(self, ctx: zmq.asyncio.Context, name: str, endpoint: str) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        # A larger frame (a rogue or broken publisher) drops the connection instead of being
        # buffered whole before the decoder refuses it; the subscription reconnects.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.IPV6, 1 if endpoint.startswith("tcp://[") else 0)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sock.connect(endpoint)
            while True:
                ready = dict(await poller.poll())
                event = await monitor.recv_multipart() if monitor in ready else None
                if event is not None and not self._on_monitor(name, endpoint, event):
                    return  # the next reconcile subscribes anew (see _on_monitor)
                if sock in ready:
                    self.index.apply_frames(name, await sock.recv_multipart())
        except zmq.ZMQError as e:  # a bad endpoint (an unresolvable host): logged, retried
            logger.warning("KV events of %s at %s: %s", name, endpoint, e)
            await asyncio.sleep(1.0)
        except Exception:  # a bug: logged, and the next reconcile subscribes anew
            logger.exception("KV events of %s at %s: the subscription failed", name, endpoint)
            self.index.clear(name)
            await asyncio.sleep(1.0)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _on_monitor(self, name: str, endpoint: str, frames: list[bytes]) -> bool:
        """A connect or disconnect of ``name``'s socket; False when the socket must be
        replaced (disconnected).

        Decision: a disconnected socket is closed and a new one made, not left to ZMQ's own
        reconnect: ZMQ does not reconnect after a protocol error (a frame over
        ``MAXMSGSIZE``, garbage from a rogue publisher), which would end the replica's
        events for good."""
        event = parse_monitor_message(frames)["event"]
        self.index.clear(name)  # connected anew, or disconnected: what it held is unknown
        if event == zmq.EVENT_CONNECTED:
            self.num_connects += 1
            logger.info("KV events of %s: subscribed at %s", name, endpoint)
            return True
        logger.info("KV events of %s: disconnected from %s", name, endpoint)
        return False
