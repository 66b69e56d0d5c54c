"""A replica's answer relayed to the client (:class:`Relay`): an event stream chunk by chunk
as the replica writes it, anything else whole; a 429 or 5xx handed back to the retry loop
instead (:class:`~iterserve.router.retry.AttemptFailed`, nothing sent yet).

A stream that stops early ends three ways: the replica cut it (an error event in OpenAI's
shape, :data:`CUT_EVENT`, and a failure of the replica), the client left (nothing more
sent), or the router's shutdown ended it (:data:`SHUTDOWN_EVENT`). Either way the response
ends cleanly when the client is still there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp

from iterserve.openai_http import APIError
from iterserve.router.asgi import (
    ProxiedRequest,
    RawHeaders,
    Send,
    back_headers,
    retry_later,
    send_error,
    send_whole,
    shutting_down,
)
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.retry import AttemptFailed, RetryReason, UpstreamAnswer

logger = logging.getLogger("iterserve.router")

# The last event of a stream whose replica went away, and of one still open when the
# router's shutdown grace period is over.
CUT_EVENT = APIError(502, "the replica serving this stream went away", "bad_gateway").event()
SHUTDOWN_EVENT = APIError(503, "the router is shutting down", "service_unavailable_error").event()


class UpstreamBody(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


class UpstreamResponse(Protocol):
    """What the relay reads of a replica's response (an ``aiohttp.ClientResponse``)."""

    status: int

    @property
    def headers(self) -> Mapping[str, str]: ...  # case-insensitive names

    @property
    def content(self) -> UpstreamBody: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class Relay:
    """Relays answers; counts them in ``metrics`` (by replica and status, cut streams as
    ``stream_cut``) and their outcome in ``pool`` (a request's success or failure)."""

    def __init__(self, pool: ReplicaPool, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def __call__(
        self, request: ProxiedRequest, send: Send, backend: Backend, response: UpstreamResponse
    ) -> None:
        """``response`` to the client: an event stream chunk by chunk (whatever the request
        body's ``stream`` looked like to the router), anything else whole.

        Raises:
            AttemptFailed: ``status_429`` or ``status_5xx``, with the answer read whole.
        """
        code = response.status
        self.metrics.requests.labels(replica=backend.name, code=str(code)).inc()
        back = back_headers(response.headers, backend.url)
        if code >= 500 or code == 429:
            try:
                body = await response.read()
            except aiohttp.ClientError:
                body = b""
            reason: RetryReason = "status_5xx" if code >= 500 else "status_429"
            raise AttemptFailed(reason, UpstreamAnswer(code, back, body))
        self.pool.record_success_request(backend)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            await self._stream(request, send, backend, response, back)
        else:
            await self._whole(request, send, backend, response, back)

    async def _whole(
        self,
        request: ProxiedRequest,
        send: Send,
        backend: Backend,
        response: UpstreamResponse,
        back: RawHeaders,
    ) -> None:
        try:
            body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as e:  # cut off after the headers
            if request.gone.is_set():
                if request.aborted:
                    await send_error(send, shutting_down())
                return
            self.pool.record_failure(backend, f"body: {type(e).__name__}", request=True)
            await send_error(
                send, retry_later(502, "the replica's answer was cut off", "bad_gateway")
            )
            return
        if not request.gone.is_set():
            await send_whole(send, response.status, back, body)

    async def _stream(
        self,
        request: ProxiedRequest,
        send: Send,
        backend: Backend,
        response: UpstreamResponse,
        back: RawHeaders,
    ) -> None:
        """Chunks as they come; a stream the replica cuts ends with an error event, one the
        client left just stops, one the shutdown ends gets the shutdown's error event."""
        await send({"type": "http.response.start", "status": response.status, "headers": back})
        try:
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as e:  # the replica died or hung mid-stream
            if request.aborted:  # the router's shutdown closed it
                last = SHUTDOWN_EVENT
            elif request.gone.is_set():
                return  # we closed it: the client left
            else:
                logger.warning("stream from %s cut off: %s: %s", backend.name, type(e).__name__, e)
                self.metrics.requests.labels(replica=backend.name, code="stream_cut").inc()
                self.pool.record_failure(backend, "stream cut off", request=True)
                last = CUT_EVENT
            await send({"type": "http.response.body", "body": last, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def close_when(gone: asyncio.Event, response: UpstreamResponse) -> None:
    """Close ``response`` once the client has gone: the replica sees the disconnect and
    aborts (a read waiting on it ends with a connection error)."""
    await gone.wait()
    response.close()
