"""The router's HTTP app: ``/v1/*``, ``/tokenize`` and ``/detokenize`` proxied to the picked
replica, streams passed through.

Per request: read the body (for the prefix key), pick a ready replica
(:mod:`iterserve.router.scoring`), send it on with the replicas' key, and relay the answer:
SSE chunk by chunk as the replica writes them, or whole. A client that goes away closes the
upstream request, so the replica aborts it and frees its KV blocks. Before the first byte has
reached the client a request is retried once on another replica after a connect error, a
timeout or a 5xx, and after a 429 when another replica has room; a replica's 429 is otherwise
passed through with its ``Retry-After``. No ready replica: 503 with ``Retry-After``. Every
attempt counts in the replica's in-flight number and gives it back in a ``finally``.

The proxied paths are plain ASGI over an aiohttp client: a relayed chunk costs one read and
one ``send``, no framework layer, which is most of what a router does (the control endpoints,
``/health``, ``/ready``, ``/load`` and ``/metrics``, are a FastAPI app).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yarl
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.scoring import NoReplicaError, Picker, prefix_key

logger = logging.getLogger("iterserve.router")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Request headers passed to the replica, and response headers passed back.
_FORWARD = frozenset((
    "content-type", "accept", "accept-encoding", "x-request-id", "x-tenant-id", "user-agent",
))  # fmt: skip
_BACK = frozenset((
    "content-type", "content-encoding", "x-request-id", "retry-after", "cache-control", "location",
))  # fmt: skip
_RETRY_AFTER_S = "1"
# Idle upstream connections are dropped before uvicorn's replicas close theirs (5 s), so a
# request never goes out on a connection the replica is closing.
KEEPALIVE_S = 4.0
# The last event of a stream whose replica went away (OpenAI's error shape, as the server's).
_CUT_EVENT = (
    b'data: {"error": {"message": "the replica serving this stream went away", '
    b'"type": "bad_gateway", "param": null, "code": null}}\n\n'
)
# The last event of a stream still open when the router's shutdown grace period is over.
_SHUTDOWN_EVENT = (
    b'data: {"error": {"message": "the router is shutting down", '
    b'"type": "service_unavailable_error", "param": null, "code": null}}\n\n'
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


class _Failed(Exception):
    """An attempt that failed before any byte went to the client (retryable)."""

    def __init__(self, reason: str, answer: _Answer | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answer = answer


@dataclass
class _Answer:
    """A replica's whole answer, kept to pass it through when no retry does better."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(eq=False)
class _Request:
    """What the proxy reads of an incoming request (hashed by identity)."""

    method: str
    path: str  # without the leading slash, decoded
    raw_path: str  # without the leading slash, as the client encoded it
    query: str
    headers: dict[str, str]  # lower-case names
    body: bytes = b""
    # Set when the client has gone away; closes the upstream response it was reading.
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    # Set (with ``gone``) when the router's shutdown ends the request: the client is still
    # there and gets an error event or a 503.
    aborted: bool = False
    # The task reading the body (a slow upload is cancelled by the shutdown), then the one
    # watching for the client's disconnect.
    reader: asyncio.Task[Any] | None = None
    watcher: asyncio.Future[None] | None = None


@dataclass
class _Active:
    """The proxied requests being answered, and whether the router's drain is over."""

    requests: set[_Request] = field(default_factory=set)
    aborting: bool = False


Background = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


class RouterApp:
    """The router's ASGI app: proxied paths handled here, the rest by ``control`` (FastAPI,
    which also runs the lifespan). ``state`` is the control app's; ``num_active`` counts the
    proxied requests being answered (the drain waits for 0); :meth:`abort_active` ends them
    when the drain is over."""

    def __init__(
        self,
        control: FastAPI,
        proxy: Callable[[Scope, Receive, Send], Awaitable[None]],
        active: _Active | None = None,
    ):
        self.control = control
        self.proxy = proxy
        self.active = active if active is not None else _Active()
        self.num_active = 0

    def abort_active(self) -> int:
        """End the proxied requests still open (the shutdown's grace period is over): their
        upstream requests are closed (the replicas abort them), streams end with an error
        event, requests not answered yet get a 503, and new ones get a 503 at once. How many
        were open."""
        self.active.aborting = True
        for request in self.active.requests:
            request.aborted = True
            request.gone.set()
            if request.reader is not None:  # still reading the body: it never would
                request.reader.cancel()
        return len(self.active.requests)

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
    settings: ProxySettings,
    background: Background | None = None,
) -> RouterApp:
    """The router's ASGI app over ``pool``.

    Args:
        background: entered for the app's lifetime (the pool's polling, discovery).
    """
    metrics = RouterMetrics()
    active = _Active()
    pool.on_eject = lambda name: metrics.ejections.labels(replica=name).inc()
    upstream: aiohttp.ClientSession | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal upstream
        upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
            ),
            auto_decompress=False,  # relayed as the replica encoded it
            skip_auto_headers=("User-Agent", "Content-Type"),
        )
        app.state.router["http"] = upstream
        try:
            async with background() if background else contextlib.nullcontext():
                yield
        finally:
            await upstream.close()

    control = FastAPI(title="iterserve router", lifespan=lifespan)
    control.state.router = {"pool": pool, "metrics": metrics, "http": None}

    @control.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The control app's own 404s and 405s in OpenAI's shape, as the proxied paths'."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, exc.status_code, headers=dict(exc.headers or {}))

    @control.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @control.get("/ready")
    async def ready() -> Response:
        if getattr(control.state, "draining", False):
            return JSONResponse({"status": "draining"}, status_code=503)
        n = len(pool.ready())
        if n:
            return JSONResponse({"status": "ready", "num_ready_replicas": n})
        return JSONResponse({"status": "no ready replica"}, status_code=503)

    @control.get("/load")
    async def load() -> dict[str, Any]:
        return pool.aggregated_load()

    @control.get("/metrics")
    async def get_metrics() -> Response:
        metrics.ready_replicas.set(len(pool.ready()))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def proxy(scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.perf_counter()
        request = _Request(
            method=scope["method"],
            path=scope["path"].lstrip("/"),
            raw_path=_raw_path(scope),
            query=scope.get("query_string", b"").decode("latin-1"),
            headers={k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
        )
        if active.aborting:
            await _send_shutting_down(send)
            return
        allowed = ("GET", "POST") if request.path.startswith("v1/") else ("POST",)
        if request.method not in allowed:
            message = f"{request.method} is not allowed on /{request.path}"
            await _send_error(send, 405, message, "invalid_request_error")
            return
        if settings.api_key is not None and not _authorized(request, settings.api_key):
            await _send_error(send, 401, "invalid or missing API key", "authentication_error")
            return
        if any(part in (".", "..") for part in request.path.split("/")):
            await _send_error(send, 404, f"no such path /{request.path}", "not_found_error")
            return
        active.requests.add(request)
        try:
            if await read_body(request, receive, send):
                await route(request, send, arrival)
        except Exception:  # a bug: still an answer in OpenAI's shape, and the traceback logged
            logger.exception("proxying %s /%s failed", request.method, request.path)
            with contextlib.suppress(Exception):  # fails if the answer had started
                message = "the router failed on this request"
                await _send_error(send, 500, message, "internal_server_error")
        finally:
            active.requests.discard(request)
            if request.watcher is not None:
                request.watcher.cancel()

    async def read_body(request: _Request, receive: Receive, send: Send) -> bool:
        """Read ``request``'s body and start watching for its client's disconnect; False
        when it has been answered already (too large, the client gone, the shutdown)."""
        limit = settings.max_request_body_bytes
        request.reader = asyncio.current_task()
        try:
            request.body = await _read_body(receive, request, limit)
        except _BodyTooLarge:
            message = f"the request body is over {limit} bytes"
            await _send_error(send, 413, message, "invalid_request_error")
            return False
        except _ClientGone:
            return False
        except asyncio.CancelledError:
            if not request.aborted or request.reader is None:
                raise
            request.reader.uncancel()  # cancelled by abort_active: a slow upload, the drain over
            await _send_shutting_down(send)
            return False
        finally:
            request.reader = None
        request.watcher = asyncio.ensure_future(_watch_disconnect(receive, request.gone))
        return True

    async def route(request: _Request, send: Send, arrival: float) -> None:
        key = _prefix_key(request.body) if request.method == "POST" else None
        session = request.headers.get(settings.session_header)
        headers = {k: _as_sent(v) for k, v in request.headers.items() if k in _FORWARD}
        headers.setdefault("accept-encoding", "identity")  # relayed as is: no re-encoding
        if settings.backend_api_key:
            headers["authorization"] = f"Bearer {settings.backend_api_key}"
        tried: set[str] = set()
        last: _Failed | None = None
        answer: _Answer | None = None  # the last replica's answer (429, 5xx), if any
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
            report = backend.state.report
            try:
                await forward(request, send, backend, headers, arrival if attempt == 0 else None)
                return
            except _Failed as e:
                last = e
                answer = e.answer or answer
                if e.reason != "status_429":
                    pool.record_failure(backend, e.reason, request=True)
                if request.gone.is_set():  # no retry for a client that left (or the shutdown)
                    if request.aborted:
                        await _send_shutting_down(send)
                    return
            finally:
                # Ended before the replica's next report: it no longer loads the replica, and
                # no report will take it off (a poll resets the count from what is open).
                if backend.state.report is report:
                    backend.state.in_flight_since_report = max(
                        0, backend.state.in_flight_since_report - 1
                    )
        if answer is not None:  # e.g. a 429 then a refused connection: the 429 comes back
            await _send_whole(send, answer.status, answer.headers, answer.body)
        elif last is not None:
            metrics.requests.labels(replica="none", code="502").inc()
            message = f"the replicas failed ({last.reason})"
            await _send_error(send, 502, message, "bad_gateway", retry=True)
        else:
            metrics.requests.labels(replica="none", code="503").inc()
            message = "no ready replica; retry later"
            await _send_error(send, 503, message, "service_unavailable_error", retry=True)

    async def forward(
        request: _Request,
        send: Send,
        backend: Backend,
        headers: dict[str, str],
        arrival: float | None,
    ) -> None:
        assert upstream is not None, "the router's lifespan has not started"
        # The path as the client encoded it (a decoded %3F or %23 would change the URL).
        url = f"{backend.url}/{request.raw_path}"
        if request.query:
            url += "?" + request.query
        backend.in_flight += 1
        try:
            await _exchange(
                request, send, backend, upstream, yarl.URL(url, encoded=True), headers, arrival
            )
        finally:
            backend.in_flight -= 1

    async def _exchange(
        request: _Request,
        send: Send,
        backend: Backend,
        http: aiohttp.ClientSession,
        url: yarl.URL,
        headers: dict[str, str],
        arrival: float | None,
    ) -> None:
        sending = asyncio.ensure_future(
            http.request(
                request.method,
                url,
                data=request.body or None,
                headers=headers,
                allow_redirects=False,  # a replica's redirect goes back to the client, as is
            )
        )
        if arrival is not None:  # body read, parsed, picked, sent: what the router adds
            metrics.proxy_overhead.observe(time.perf_counter() - arrival)
        gone = asyncio.ensure_future(request.gone.wait())
        try:
            # The client may leave while the replica works (a non-streamed answer comes
            # whole): watch for it all along, and close the upstream request when it happens.
            done, _ = await asyncio.wait(
                {sending, gone},
                timeout=settings.first_byte_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if sending not in done:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    (await sending).close()
                if gone in done:
                    if request.aborted:
                        await _send_shutting_down(send)
                    return  # nobody reads an answer
                raise _Failed("timeout")
            response = sending.result()
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise _Failed("timeout") from e
        except aiohttp.ClientError as e:  # refused, reset, closed before the headers
            raise _Failed("connect") from e
        finally:
            gone.cancel()
        # From here the response is ours to close; a disconnect closes it too.
        closer = asyncio.ensure_future(_close_when(request.gone, response))
        try:
            await _relay(request, send, backend, response)
        finally:
            closer.cancel()
            response.close()

    async def _relay(
        request: _Request,
        send: Send,
        backend: Backend,
        response: aiohttp.ClientResponse,
    ) -> None:
        code = response.status
        metrics.requests.labels(replica=backend.name, code=str(code)).inc()
        back = _back_headers(response, backend)
        if code >= 500 or code == 429:
            try:
                body = await response.read()
            except aiohttp.ClientError:
                body = b""
            reason = "status_5xx" if code >= 500 else "status_429"
            raise _Failed(reason, _Answer(code, back, body))
        pool.record_success_request(backend)
        # Streamed as the replica streams (whatever the body's ``stream`` looked like to the
        # router: a replica may read ``"stream": 1`` as true).
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                body = await response.read()
            except (aiohttp.ClientError, TimeoutError) as e:  # cut off after the headers
                if request.gone.is_set():
                    if request.aborted:
                        await _send_shutting_down(send)
                    return
                pool.record_failure(backend, f"body: {type(e).__name__}", request=True)
                await _send_error(
                    send, 502, "the replica's answer was cut off", "bad_gateway", True
                )
                return
            if not request.gone.is_set():
                await _send_whole(send, code, back, body)
            return
        await send({"type": "http.response.start", "status": code, "headers": back})
        try:
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as e:  # the replica died or hung mid-stream
            if request.aborted:  # the router's shutdown closed it
                last = _SHUTDOWN_EVENT
            elif request.gone.is_set():
                return  # we closed it: the client left
            else:
                logger.warning("stream from %s cut off: %s: %s", backend.name, type(e).__name__, e)
                metrics.requests.labels(replica=backend.name, code="stream_cut").inc()
                pool.record_failure(backend, "stream cut off", request=True)
                last = _CUT_EVENT
            await send({"type": "http.response.body", "body": last, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return RouterApp(control, proxy, active)


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _authorized(request: _Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def _prefix_key(body: bytes) -> bytes | None:
    """The prefix key of a generation body; None when it is not a JSON object."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    messages = data.get("messages")
    prompt = data.get("prompt")
    if isinstance(messages, list):
        key = prefix_key(messages=[m for m in messages if isinstance(m, dict)])
    elif isinstance(prompt, str):
        key = prefix_key(prompt)
    else:
        key = None
    return key or None


async def _read_body(receive: Receive, request: _Request, limit: int) -> bytes:
    """The request body.

    Raises:
        _BodyTooLarge: it is over ``limit`` bytes (declared or read; not read further).
        _ClientGone: the client disconnected first.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _as_sent(value: str) -> str:
    """A header value (decoded as latin-1) as aiohttp must be given it to send the client's
    bytes: it encodes values as UTF-8, so a UTF-8 value is decoded as such (it arrived as
    mojibake at the replica); bytes that are not UTF-8 stay latin-1 (re-encoded)."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        return value


def _raw_path(scope: Scope) -> str:
    """The request's path as the client encoded it, without the leading slash (bytes outside
    printable ASCII percent-encoded; the escapes it has kept)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    return urllib.parse.quote(raw, safe="!$%&'()*+,/:;=@~").lstrip("/")


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _close_when(gone: asyncio.Event, response: aiohttp.ClientResponse) -> None:
    """Close ``response`` once the client has gone: the replica sees the disconnect and
    aborts (a read waiting on it ends with a connection error)."""
    await gone.wait()
    response.close()


def _back_headers(
    response: aiohttp.ClientResponse, backend: Backend | None = None
) -> list[tuple[bytes, bytes]]:
    """The replica's headers a client needs, and which replica answered (``x-routed-to``):
    the bytes the replica sent (aiohttp decodes them as UTF-8 with surrogate escapes; a value
    outside latin-1 used to raise here, a 500)."""
    headers = [
        (k.lower().encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
        for k, v in response.headers.items()
        if k.lower() in _BACK
    ]
    if backend is not None:
        headers.append((b"x-routed-to", backend.name.encode("latin-1")))
    return headers


async def _send_whole(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_shutting_down(send: Send) -> None:
    message = "the router is shutting down; retry"
    await _send_error(send, 503, message, "service_unavailable_error", retry=True)


async def _send_error(
    send: Send, status: int, message: str, kind: str, retry: bool = False
) -> None:
    """OpenAI's error shape, as the replicas answer."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    headers = [(b"content-type", b"application/json")]
    if retry:
        headers.append((b"retry-after", _RETRY_AFTER_S.encode()))
    await _send_whole(send, status, headers, json.dumps(body).encode())
