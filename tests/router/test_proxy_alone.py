"""The proxy's concepts alone, over a fake upstream (no sockets, no replicas): refusals,
picks, one attempt forwarded and relayed (whole, streamed, cut, left by its client, ended
by the shutdown) and the retry loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from iterserve.credentials import Grant
from iterserve.router.asgi import ProxiedRequest
from iterserve.router.config import RouterConfig
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.proxy import Proxy
from iterserve.router.relay import CUT_EVENT, SHUTDOWN_EVENT
from iterserve.router.retry import AttemptFailed
from iterserve.router.scoring import Picker

A, B = "http://a:1", "http://b:1"
SSE = {"content-type": "text/event-stream"}


class FakeResponse:
    """A replica's response: ``chunks`` streamed, then ``end``: None (done), an exception
    raised, or ``"hang"`` (waits until closed, then fails as aiohttp does)."""

    def __init__(
        self,
        status: int = 200,
        headers: dict[str, str] | None = None,
        chunks: tuple[bytes, ...] = (),
        end: BaseException | str | None = None,
    ) -> None:
        self.status = status
        self.headers = CIMultiDict(headers if headers is not None else SSE)
        self.content = self
        self.chunks = chunks
        self.end = end
        self.closed = asyncio.Event()

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.end == "hang":
            await self.closed.wait()
            raise aiohttp.ClientConnectionError("Connection closed")
        if isinstance(self.end, BaseException):
            raise self.end

    async def read(self) -> bytes:
        if isinstance(self.end, BaseException):
            raise self.end
        return b"".join(self.chunks)

    def close(self) -> None:
        self.closed.set()


class FakeHTTP:
    """The upstream session: per replica URL a response, or an exception to raise."""

    def __init__(self, answers: dict[str, FakeResponse | BaseException]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    async def request(self, method: str, url: Any, **kwargs: Any) -> FakeResponse:
        self.sent.append((method, str(url), kwargs))
        answer = next(v for k, v in self.answers.items() if str(url).startswith(k))
        if isinstance(answer, BaseException):
            raise answer
        return answer


class Client:
    """The ASGI send side: the messages the client got."""

    def __init__(self, on_chunk: Any = None) -> None:
        self.messages: list[MutableMapping[str, Any]] = []
        self.on_chunk = on_chunk

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and self.on_chunk is not None:
            self.on_chunk()

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    @property
    def ended(self) -> bool:
        return self.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def _proxy(urls: tuple[str, ...] = (A,), **settings: Any) -> Proxy:
    pool = ReplicaPool()
    pool.set_urls(list(urls))
    for b in pool.backends.values():
        b.state.ready = True
    config = RouterConfig(backend=urls, **settings)
    return Proxy(pool, Picker("round_robin"), config, RouterMetrics())


def _request(method: str = "POST", path: str = "/v1/completions", **headers: str) -> ProxiedRequest:
    scope = {
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [
            (k.replace("_", "-").encode(), v.encode("latin-1")) for k, v in headers.items()
        ],
    }
    request = ProxiedRequest.from_scope(scope)
    request.body = b'{"prompt": "hi"}'
    return request


def _error(client: Client) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(client.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ----------------------------------------------------------------- refusals


def test_refusals() -> None:
    proxy = _proxy(api_key="k")
    ok = {"authorization": "Bearer k"}
    assert proxy.refusal(_request(**ok)) is None
    assert proxy.refusal(_request(authorization="bEaReR k")) is None  # any case
    assert proxy.refusal(_request("GET", "/v1/models", **ok)) is None
    for request, status in [
        (_request(), 401),
        (_request(authorization="Bearer x"), 401),
        (_request(authorization="Basic k"), 401),
        (_request("GET", "/tokenize", **ok), 405),
        (_request("PUT", "/v1/completions", **ok), 405),
        (_request("POST", "/v1/../admin", **ok), 404),
    ]:
        error = proxy.refusal(request)
        assert error is not None and error.status == status, (request, error)
    # A 405 names what the path takes.
    error = proxy.refusal(_request("PUT", "/v1/completions", **ok))
    assert error is not None and error.headers == {"allow": "GET, POST"}
    error = proxy.refusal(_request("GET", "/tokenize", **ok))
    assert error is not None and error.headers == {"allow": "POST"}
    # Two Authorization headers, one of them right, are no key.
    scope = {
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"authorization", b"Bearer x"), (b"authorization", b"Bearer k")],
    }
    error = proxy.refusal(ProxiedRequest.from_scope(scope))
    assert error is not None and error.status == 401
    proxy.abort_active()
    error = proxy.refusal(_request(**ok))
    assert error is not None and (error.status, error.headers) == (503, {"retry-after": "1"})


def test_pick_skips_the_replicas_tried_and_counts_retries() -> None:
    from iterserve.router.retry import Attempts

    proxy = _proxy((A, B))
    attempts = Attempts()
    decision = proxy.decider.decide("POST", Grant(), {}, b"{}")
    first = proxy.pick(attempts, decision)
    assert first is not None
    attempts.started(first.name)
    attempts.failed(AttemptFailed("connect"))
    second = proxy.pick(attempts, decision)
    assert second is not None and second.name != first.name
    attempts.started(second.name)
    assert proxy.pick(attempts, decision) is None
    assert proxy.metrics.retries.labels(reason="connect")._value.get() == 1


# ----------------------------------------------------------------- relay


def _relay(proxy: Proxy, response: FakeResponse, client: Client, request: ProxiedRequest) -> None:
    backend = proxy.pool.backends[A]
    asyncio.run(proxy.relay(request, client.send, backend, response))


def test_a_stream_is_relayed_chunk_by_chunk() -> None:
    proxy, client = _proxy(), Client()
    response = FakeResponse(chunks=(b"data: 1\n\n", b"data: [DONE]\n\n"))
    _relay(proxy, response, client, _request())
    assert client.status == 200
    assert (b"x-routed-to", A.encode()) in client.messages[0]["headers"]
    assert [m["body"] for m in client.messages[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert client.ended


def test_a_whole_answer_is_relayed_with_its_length() -> None:
    proxy, client = _proxy(), Client()
    response = FakeResponse(headers={"content-type": "application/json"}, chunks=(b"{}",))
    _relay(proxy, response, client, _request())
    assert (b"content-length", b"2") in client.messages[0]["headers"]
    assert client.body == b"{}"


@pytest.mark.parametrize(("status", "reason"), [(429, "status_429"), (503, "status_5xx")])
def test_a_full_or_failing_replica_is_an_attempt_failed_before_the_first_byte(
    status: int, reason: str
) -> None:
    proxy, client = _proxy(), Client()
    response = FakeResponse(status, {"retry-after": "7"}, (b"full",))
    with pytest.raises(AttemptFailed) as failed:
        _relay(proxy, response, client, _request())
    assert failed.value.reason == reason
    assert failed.value.answer is not None and failed.value.answer.body == b"full"
    assert (b"retry-after", b"7") in failed.value.answer.headers
    assert client.messages == []  # nothing reached the client: another replica may answer


def test_a_stream_the_replica_cuts_ends_with_an_error_event() -> None:
    proxy, client = _proxy(), Client()
    cut = aiohttp.ClientPayloadError("Response payload is not completed")
    _relay(proxy, FakeResponse(chunks=(b"data: 1\n\n",), end=cut), client, _request())
    assert client.body == b"data: 1\n\n" + CUT_EVENT
    assert json.loads(CUT_EVENT[len(b"data: ") :])["error"]["type"] == "bad_gateway"
    assert client.ended
    assert proxy.pool.backends[A].request_failures == 1
    # Labelled by the replica's name (host:port for a --backend URL), not its URL.
    assert proxy.metrics.requests.labels(replica="a:1", code="stream_cut")._value.get() == 1


def test_a_whole_answer_cut_off_is_a_502() -> None:
    proxy, client = _proxy(), Client()
    response = FakeResponse(headers={"content-type": "application/json"}, end=TimeoutError())
    _relay(proxy, response, client, _request())
    assert client.status == 502 and _error(client)["type"] == "bad_gateway"
    assert proxy.pool.backends[A].request_failures == 1


# ----------------------------------------------------------------- one attempt


def _forward(proxy: Proxy, request: ProxiedRequest, client: Client) -> None:
    backend: Backend = proxy.pool.backends[A]

    async def run() -> None:
        await proxy.forward(request, client.send, backend, {}, None)

    asyncio.run(run())


def test_a_client_leaving_mid_stream_closes_the_upstream_response() -> None:
    """The client goes after the first chunk: the response is closed (the replica aborts),
    nothing more is sent, the replica is not blamed, and the attempt no longer counts."""
    proxy = _proxy()
    request = _request()
    response = FakeResponse(chunks=(b"data: 1\n\n",), end="hang")
    proxy.http = FakeHTTP({A: response})
    client = Client(on_chunk=request.gone.set)  # the disconnect, seen after the first chunk
    _forward(proxy, request, client)
    assert response.closed.is_set()
    assert [m["body"] for m in client.messages[1:]] == [b"data: 1\n\n"]  # no event, no end
    backend = proxy.pool.backends[A]
    assert backend.request_failures == 0
    assert backend.in_flight == backend.state.in_flight_since_report == 0


def test_the_shutdown_ends_an_open_stream_with_its_error_event() -> None:
    proxy = _proxy()
    request = _request()
    response = FakeResponse(chunks=(b"data: 1\n\n",), end="hang")
    proxy.http = FakeHTTP({A: response})
    proxy.active.add(request)
    client = Client(on_chunk=lambda: proxy.abort_active())
    _forward(proxy, request, client)
    assert client.body == b"data: 1\n\n" + SHUTDOWN_EVENT
    assert client.ended
    assert proxy.pool.backends[A].request_failures == 0


def test_a_refused_connection_is_a_connect_failure_and_the_attempt_ends() -> None:
    proxy = _proxy()
    proxy.http = FakeHTTP({A: aiohttp.ClientConnectionError("refused")})
    with pytest.raises(AttemptFailed) as failed:
        _forward(proxy, _request(), Client())
    assert failed.value.reason == "connect"
    assert proxy.pool.backends[A].in_flight == 0


# ----------------------------------------------------------------- the retry loop


def _route(proxy: Proxy, request: ProxiedRequest) -> Client:
    client = Client()
    asyncio.run(proxy.route(request, client.send, 0.0))
    return client


def _in_pick_order(proxy: Proxy) -> list[str]:
    """The replicas' URLs in the order ``round_robin`` tries them (the pool's order)."""
    return [proxy.pool.named(state.name).url for state in proxy.pool.states()]


def test_a_failed_attempt_is_retried_on_the_other_replica() -> None:
    proxy = _proxy((A, B), backend_api_key="inner")
    first, second = _in_pick_order(proxy)
    ok = FakeResponse(headers={"content-type": "application/json"}, chunks=(b"{}",))
    http = FakeHTTP({first: aiohttp.ClientConnectionError("refused"), second: ok})
    proxy.http = http
    client = _route(proxy, _request(authorization="Bearer outer", x_request_id="r1"))
    assert client.status == 200 and client.body == b"{}"
    assert [url for _, url, _ in http.sent] == [
        f"{first}/v1/completions",
        f"{second}/v1/completions",
    ]
    headers = http.sent[1][2]["headers"]
    assert headers["authorization"] == "Bearer inner"  # the replicas' key, not the client's
    assert headers["x-request-id"] == "r1"
    assert proxy.pool.backends[first].request_failures == 1
    assert proxy.pool.backends[second].request_failures == 0
    assert proxy.metrics.retries.labels(reason="connect")._value.get() == 1
    assert all(b.in_flight == 0 for b in proxy.pool.backends.values())


def test_a_429_then_a_failure_passes_the_429_through_without_blaming_the_full_replica() -> None:
    proxy = _proxy((A, B))
    full_one, failing = _in_pick_order(proxy)
    full = FakeResponse(429, {"retry-after": "7"}, (b"full",))
    proxy.http = FakeHTTP({full_one: full, failing: TimeoutError()})
    client = _route(proxy, _request())
    assert client.status == 429 and client.body == b"full"
    assert (b"retry-after", b"7") in client.messages[0]["headers"]
    assert (b"x-routed-to", full_one.encode()) in client.messages[0]["headers"]
    assert proxy.pool.backends[full_one].request_failures == 0
    assert proxy.pool.backends[failing].request_failures == 1


def test_no_ready_replica_is_a_503_to_retry_later() -> None:
    proxy = _proxy(hold_timeout_s=0)
    proxy.pool.backends[A].state.ready = False
    client = _route(proxy, _request())
    assert client.status == 503 and (b"retry-after", b"1") in client.messages[0]["headers"]
    assert _error(client)["type"] == "service_unavailable_error"


def test_no_retry_for_a_client_that_left() -> None:
    proxy = _proxy((A, B))
    request = _request()

    class LeavesThenFails(FakeHTTP):
        async def request(self, method: str, url: Any, **kwargs: Any) -> FakeResponse:
            request.gone.set()
            return await super().request(method, url, **kwargs)

    http = LeavesThenFails({A: TimeoutError(), B: TimeoutError()})
    proxy.http = http
    client = _route(proxy, request)
    assert len(http.sent) == 1 and client.messages == []
