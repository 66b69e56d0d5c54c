"""The client's side of a proxied request, in plain ASGI: what the router reads of a request
(:class:`ProxiedRequest`, its body within a limit, its client's disconnect), the headers
passed each way, and whole answers sent back (errors in OpenAI's shape)."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from iterserve.credentials import TRUSTED_HEADERS, Grant
from iterserve.openai_http import APIError, authorization_header

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]

# Request headers passed to the replica, and response headers passed back.
FORWARD_HEADERS = frozenset((
    "content-type", "accept", "accept-encoding", "x-request-id", "x-tenant-id", "user-agent",
))  # fmt: skip
BACK_HEADERS = frozenset((
    "content-type", "content-encoding", "x-request-id", "retry-after", "cache-control", "location",
    "allow",
))  # fmt: skip
RETRY_AFTER_S = "1"


@dataclass(eq=False)
class ProxiedRequest:
    """What the proxy reads of an incoming request (hashed by identity)."""

    method: str
    path: str  # without the leading slash, decoded
    raw_path: str  # without the leading slash, as the client encoded it
    query: str
    headers: dict[str, str]  # lower-case names, values decoded as latin-1
    authorization: bytes = b""  # the one Authorization header, b"" for none or several
    grant: Grant | None = None  # what its key allows (router.auth), once checked
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

    @classmethod
    def from_scope(cls, scope: Scope) -> ProxiedRequest:
        return cls(
            method=scope["method"],
            path=scope["path"].lstrip("/"),
            raw_path=_raw_path(scope),
            query=scope.get("query_string", b"").decode("latin-1"),
            headers={k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
            authorization=authorization_header(scope["headers"]),
        )

    def abort(self) -> None:
        """End the request for the router's shutdown: its upstream request closes, a body
        still being read stops being waited for."""
        self.aborted = True
        self.gone.set()
        if self.reader is not None:
            self.reader.cancel()


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, request: ProxiedRequest, limit: int) -> bytes:
    """The request body.

    Raises:
        BodyTooLarge: it is over ``limit`` bytes (declared or read; not read further).
        ClientGone: the client disconnected first.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set ``gone`` when the client disconnects (the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def forward_headers(
    request: ProxiedRequest, authorization: str | None, trusted: dict[str, str] | None = None
) -> dict[str, str]:
    """The headers sent to the replica: the client's :data:`FORWARD_HEADERS` (not its key),
    the replicas' ``authorization`` if any, and ``accept-encoding: identity`` unless the
    client asked otherwise (the answer is relayed as encoded). ``trusted`` (the router's
    tenant and tier headers) replaces whatever the client sent of those."""
    headers = {k: _as_sent(v) for k, v in request.headers.items() if k in FORWARD_HEADERS}
    headers.setdefault("accept-encoding", "identity")
    if trusted is not None:
        headers = {k: v for k, v in headers.items() if k not in TRUSTED_HEADERS} | trusted
    if authorization:
        headers["authorization"] = authorization
    return headers


def back_headers(headers: Mapping[str, str], replica: str) -> RawHeaders:
    """The replica's headers a client needs (:data:`BACK_HEADERS`), and which replica
    answered (``x-routed-to``): the bytes the replica sent (aiohttp decodes them as UTF-8
    with surrogate escapes, so a value outside latin-1 is passed through as sent)."""
    raw = [
        (k.lower().encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
        for k, v in headers.items()
        if k.lower() in BACK_HEADERS
    ]
    return [*raw, (b"x-routed-to", replica.encode("latin-1"))]


async def send_whole(send: Send, status: int, headers: RawHeaders, body: bytes) -> None:
    """A whole answer, with its ``content-length``."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: APIError) -> None:
    """``error`` as a JSON answer in OpenAI's shape, with its headers."""
    headers = [(b"content-type", b"application/json")]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()
    ]
    await send_whole(send, error.status, headers, json.dumps(error.body()).encode())


def retry_later(status: int, message: str, type: str) -> APIError:
    """An error the client should retry after :data:`RETRY_AFTER_S` (a 502 or 503)."""
    return APIError(status, message, type, headers={"retry-after": RETRY_AFTER_S})


def shutting_down() -> APIError:
    """The answer to a request the router's shutdown ends before it is answered."""
    return retry_later(503, "the router is shutting down; retry", "service_unavailable_error")


def _as_sent(value: str) -> str:
    """A header value (decoded as latin-1) as aiohttp must be given it to send the client's
    bytes: it encodes values as UTF-8, so a UTF-8 value is decoded as such; bytes that are
    not UTF-8 stay latin-1 (re-encoded)."""
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
