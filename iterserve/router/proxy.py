"""The router's HTTP app: ``/v1/*``, ``/tokenize`` and ``/detokenize`` proxied to the picked
replica, streams passed through.

Per request: read the body (for the prefix key and ``stream``), pick a ready replica
(:mod:`iterserve.router.scoring`), send it on with the replicas' key, and relay the answer:
SSE chunk by chunk as the replica writes them (``aiter_raw``, nothing buffered), or whole.
A client that goes away closes the upstream request, so the replica aborts it and frees its
KV blocks. Before the first byte has reached the client a request is retried once on another
replica after a connect error, a timeout or a 5xx, and after a 429 when another replica has
room; a replica's 429 is otherwise passed through with its ``Retry-After``. No ready replica:
503 with ``Retry-After``. Every attempt counts in the replica's in-flight number and gives it
back in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.scoring import NoReplicaError, Picker, prefix_key

logger = logging.getLogger("iterserve.router")

# Request headers passed to the replica, and response headers passed back.
_FORWARD = (
    "content-type", "accept", "accept-encoding", "x-request-id", "x-tenant-id", "user-agent",
)  # fmt: skip
_BACK = (
    "content-type", "content-encoding", "x-request-id", "retry-after", "cache-control", "location",
)  # fmt: skip
_RETRY_AFTER_S = "1"
# The last event of a stream whose replica went away (OpenAI's error shape, as the server's).
_CUT_EVENT = (
    b'data: {"error": {"message": "the replica serving this stream went away", '
    b'"type": "bad_gateway", "param": null, "code": null}}\n\n'
)


@dataclass(frozen=True)
class ProxySettings:
    """Knobs of the proxy (``iterserve router`` flags)."""

    api_key: str | None = None
    backend_api_key: str | None = None
    session_header: str = "x-session-id"
    connect_timeout_s: float = 2.0
    # Until the replica's response headers (a non-streamed answer comes whole: allow for it).
    first_byte_timeout_s: float = 300.0
    # Between two chunks of a stream.
    read_timeout_s: float = 600.0
    max_request_body_bytes: int = 4 << 20  # the replicas' default limit


def _error(status: int, message: str, kind: str, retry: bool = False) -> JSONResponse:
    headers = {"Retry-After": _RETRY_AFTER_S} if retry else {}
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Failed(Exception):
    """An attempt that failed before any byte went to the client (retryable)."""

    def __init__(
        self, reason: str, response: httpx.Response | None = None, backend: Backend | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response
        self.backend = backend


Background = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


def build_router_app(
    pool: ReplicaPool,
    picker: Picker,
    settings: ProxySettings,
    background: Background | None = None,
) -> FastAPI:
    """The router's FastAPI app over ``pool``.

    Args:
        background: entered for the app's lifetime (the pool's polling, discovery).
    """
    metrics = RouterMetrics()
    pool.on_eject = lambda name: metrics.ejections.labels(replica=name).inc()
    timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    upstream = httpx.AsyncClient(timeout=timeout, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with upstream, background() if background else contextlib.nullcontext():
            yield

    app = FastAPI(title="iterserve router", lifespan=lifespan)
    app.state.router = {"pool": pool, "metrics": metrics, "http": upstream}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        n = len(pool.ready())
        if n:
            return JSONResponse({"status": "ready", "num_ready_replicas": n})
        return JSONResponse({"status": "no ready replica"}, status_code=503)

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return pool.aggregated_load()

    @app.get("/metrics")
    async def get_metrics() -> Response:
        metrics.ready_replicas.set(len(pool.ready()))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def proxy_v1(path: str, request: Request) -> Response:
        return await proxy(f"v1/{path}", request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await proxy("tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await proxy("detokenize", request)

    async def proxy(path: str, request: Request) -> Response:
        arrival = time.perf_counter()
        if settings.api_key is not None and not _authorized(request, settings.api_key):
            return _error(401, "invalid or missing API key", "authentication_error")
        if any(part in (".", "..") for part in path.split("/")):
            return _error(404, f"no such path /{path}", "not_found_error")
        body = await _read_body(request, settings.max_request_body_bytes)
        if body is None:
            limit = settings.max_request_body_bytes
            return _error(413, f"the request body is over {limit} bytes", "invalid_request_error")
        key, stream = _inspect(body) if request.method == "POST" else (None, False)
        session = request.headers.get(settings.session_header)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        headers.setdefault("accept-encoding", "identity")  # relayed as is: no re-encoding
        if settings.backend_api_key:
            headers["authorization"] = f"Bearer {settings.backend_api_key}"
        tried: set[str] = set()
        last: _Failed | None = None
        for attempt in range(2):
            candidates = [s for s in pool.states() if s.name not in tried]
            try:
                pick = picker.pick(candidates, time.monotonic(), key, session)
            except NoReplicaError:
                break
            if last is not None:  # this attempt is a retry
                metrics.retries.labels(reason=last.reason).inc()
            metrics.picks.labels(policy=picker.policy, reason=pick.reason).inc()
            backend = pool.backends[pick.replica.name]
            tried.add(backend.name)
            backend.state.in_flight_since_report += 1
            try:
                return await _forward(
                    request, backend, path, body, headers, stream, arrival if attempt == 0 else None
                )
            except _Failed as e:
                last = e
                if e.reason != "status_429":
                    pool.record_failure(backend, e.reason, request=True)
        if last is not None and last.response is not None:
            return _passthrough(last.response, last.backend)
        if last is not None:
            metrics.requests.labels(replica="none", code="502").inc()
            return _error(502, f"the replicas failed ({last.reason})", "bad_gateway", retry=True)
        metrics.requests.labels(replica="none", code="503").inc()
        return _error(503, "no ready replica; retry later", "service_unavailable_error", True)

    async def _forward(
        request: Request,
        backend: Backend,
        path: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
        arrival: float | None,
    ) -> Response:
        url = f"{backend.url}/{path}"
        if request.url.query:
            url += "?" + request.url.query
        outgoing = upstream.build_request(request.method, url, content=body, headers=headers)
        backend.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                backend.in_flight -= 1

        # The client may leave while the replica works (a non-streamed answer comes whole):
        # watch for it all along, and close the upstream request when it happens.
        gone = asyncio.ensure_future(_wait_disconnect(request))
        if arrival is not None:  # body read, parsed, picked, built: what the router adds
            metrics.proxy_overhead.observe(time.perf_counter() - arrival)
        sending = asyncio.ensure_future(
            asyncio.wait_for(upstream.send(outgoing, stream=True), settings.first_byte_timeout_s)
        )
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await sending
                release()
                return Response(status_code=499)  # nobody reads it
            response = sending.result()
        except (TimeoutError, httpx.TimeoutException) as e:
            gone.cancel()
            release()
            raise _Failed("timeout") from e
        except httpx.TransportError as e:  # refused, reset, closed before the headers
            gone.cancel()
            release()
            raise _Failed("connect") from e
        except BaseException:
            gone.cancel()
            release()
            raise
        code = response.status_code
        metrics.requests.labels(replica=backend.name, code=str(code)).inc()
        if code >= 500 or code == 429:
            gone.cancel()
            await response.aread()
            await response.aclose()
            release()
            raise _Failed("status_5xx" if code >= 500 else "status_429", response, backend)
        pool.record_success_request(backend)
        if not stream or not response.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            try:
                content = await _read_unless_disconnected(gone, response)
            except httpx.HTTPError as e:  # cut off after the headers: nothing sent yet
                pool.record_failure(backend, f"body: {type(e).__name__}", request=True)
                return _error(502, "the replica's answer was cut off", "bad_gateway", retry=True)
            finally:
                await response.aclose()
                release()
            if content is None:
                return Response(status_code=499)
            return Response(content, code, _back_headers(response, backend))

        gone.cancel()  # the streaming response listens for the disconnect itself

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the replica died or hung mid-stream
                logger.warning("stream from %s cut off: %s: %s", backend.name, type(e).__name__, e)
                metrics.requests.labels(replica=backend.name, code="stream_cut").inc()
                pool.record_failure(backend, "stream cut off", request=True)
                yield _CUT_EVENT
            finally:  # also when the client went away: the replica sees its disconnect
                await response.aclose()
                release()

        return StreamingResponse(relay(), code, _back_headers(response, backend))

    return app


def _authorized(request: Request, api_key: str) -> bool:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def _inspect(body: bytes) -> tuple[bytes | None, bool]:
    """(prefix key, streamed) of a generation body; (None, False) when it is not JSON."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, False
    if not isinstance(data, dict):
        return None, False
    messages = data.get("messages")
    prompt = data.get("prompt")
    if isinstance(messages, list):
        key = prefix_key(messages=[m for m in messages if isinstance(m, dict)])
    elif isinstance(prompt, str):
        key = prefix_key(prompt)
    else:
        key = None
    return key or None, data.get("stream") is True


async def _read_unless_disconnected(
    gone: asyncio.Future[None], response: httpx.Response
) -> bytes | None:
    """The whole body, or None when the client disconnects first (``gone``; the upstream is
    then closed, so the replica aborts)."""
    read = asyncio.ensure_future(response.aread())
    waiting: set[asyncio.Future[Any]] = {read, gone}
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if read in done:
        gone.cancel()
        return read.result()
    read.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await read
    return None


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it is over ``limit`` bytes (not read further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _back_headers(response: httpx.Response, backend: Backend | None = None) -> dict[str, str]:
    """The replica's headers a client needs, and which replica answered (``x-routed-to``)."""
    headers = {k: v for k, v in response.headers.items() if k.lower() in _BACK}
    if backend is not None:
        headers["x-routed-to"] = backend.name
    return headers


def _passthrough(response: httpx.Response, backend: Backend | None) -> Response:
    return Response(response.content, response.status_code, _back_headers(response, backend))
