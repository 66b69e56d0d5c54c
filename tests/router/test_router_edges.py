"""The router at its edges: the end of the shutdown's grace
period and a second SIGTERM end open requests with an error rather than cutting them, paths
reach the replica as the client encoded them, the control app's errors are in OpenAI's shape,
and a replica's event stream is relayed as a stream whatever the body's ``stream`` said."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from router_utils import pool_of, router, until
from server_utils import Server, run_server
from sim_profiles import make_profile, write_profile

from iterserve.router import decide

PROFILE = make_profile(fixed_s=0.020)  # 20 ms per token: a 1000-token stream lasts 20 s


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_profile(tmp_path_factory.mktemp("router-edges") / "profile.json", PROFILE)


LONG = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True}


async def _stream_events(http: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
    """The events of a long stream (``started`` set at its first), read to the end."""
    events = []
    async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
                started.set()
    return events


def _stopped_within(r: Server, seconds: float) -> float:
    start = time.monotonic()
    assert r.proc.wait(seconds) == 0
    return time.monotonic() - start


def _replica_idle(replica: Server) -> bool:
    return httpx.get(replica.url + "/load").json()["num_running"] == 0


def test_open_requests_end_with_an_error_when_the_grace_period_is_over(
    profile_file: Path,
) -> None:
    """A stream still open after --shutdown-grace-period-s ends with an error event and a
    clean end of the response, a non-streamed request still waiting gets a 503 (and so does
    one whose body is still coming), the replica aborts both, and the router exits 0 right
    then (not 10 s later, streams cut mid-chunk)."""
    with run_server("--simulate", str(profile_file)) as replica:
        flags = ("--backend", replica.url, "--poll-interval-ms", "20")
        with run_server(*flags, "--shutdown-grace-period-s", "1", command="router") as r:
            _grace_period_over(replica, r)


async def _slow_upload(url: str) -> bytes:
    """A request whose body never arrives in full: what the router answers it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 1000\r\n\r\n"
    writer.write(head + b'{"prompt": ')
    answer = await reader.read(65536)
    writer.close()
    return answer


def _grace_period_over(replica: Server, r: Server) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=r.url, timeout=30) as http:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream_events(http, started))
            whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
            upload = asyncio.create_task(_slow_upload(r.url))
            await asyncio.wait_for(started.wait(), 10)
            r.proc.send_signal(signal.SIGTERM)
            events, answer, uploaded = await asyncio.wait_for(
                asyncio.gather(stream, whole, upload), 5
            )
        # The slow upload too: a 503 (it kept the router 10 s past the grace period).
        assert uploaded.startswith(b"HTTP/1.1 503 "), uploaded
        error = json.loads(events[-1][len("data: ") :])["error"]
        assert error["type"] == "service_unavailable_error", events[-1]
        assert set(error) == {"message", "type", "param", "code"}
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["message"].startswith("the router is shutting down")
        assert answer.headers["retry-after"] == "1"

    asyncio.run(run())
    assert _stopped_within(r, 3) < 3
    deadline = time.monotonic() + 5
    while not _replica_idle(replica):  # both aborted at the replica
        assert time.monotonic() < deadline, "the replica still runs the router's requests"
        time.sleep(0.05)


def test_a_second_sigterm_ends_the_drain_at_once(profile_file: Path) -> None:
    with (
        run_server("--simulate", str(profile_file)) as replica,
        run_server("--backend", replica.url, "--poll-interval-ms", "20", command="router") as r,
    ):

        async def run() -> None:
            async with httpx.AsyncClient(base_url=r.url, timeout=30) as http:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream_events(http, started))
                await asyncio.wait_for(started.wait(), 10)
                r.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                assert r.proc.poll() is None  # draining
                r.proc.send_signal(signal.SIGTERM)
                events = await asyncio.wait_for(stream, 3)
            assert '"the router is shutting down"' in events[-1], events[-1]

        asyncio.run(run())
        assert _stopped_within(r, 3) < 3
        assert "Traceback" not in r.log_text()


def _fake_replica() -> FastAPI:
    """A vLLM-like replica: metrics for the router's polls, an event stream (whatever the
    body says), and the path each request arrived with."""
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0\n"
        )

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            await asyncio.sleep(1.0)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def full() -> Response:
        body = b'{"error": {"message": "full", "type": "x", "param": null, "code": null}}'
        return Response(body, 429, {"retry-after": "7"}, media_type="application/json")

    @app.get("/load")  # the poll must not follow it (auto: /metrics then)
    async def load() -> Response:
        return Response(status_code=307, headers={"location": "http://elsewhere.invalid/load"})

    @app.post("/v1/moved")
    async def moved() -> Response:
        return Response(status_code=307, headers={"location": "http://elsewhere.invalid/v1/x"})

    @app.get("/v1/utf8-header")
    async def utf8_header() -> Response:
        response = Response(b"{}", media_type="application/json")
        response.raw_headers.append((b"x-request-id", "café-€".encode()))  # not latin-1
        return response

    @app.get("/v1/{rest:path}")
    async def echo(request: Request) -> dict[str, str]:
        tenant = dict(request.scope["headers"]).get(b"x-tenant-id", b"")
        seen = {"raw_path": request.scope["raw_path"].decode(), "query": str(request.url.query)}
        return {**seen, "tenant": tenant.hex()} if tenant else seen

    return app


def test_paths_headers_streams_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        fake = uvicorn.Server(uvicorn.Config(_fake_replica(), log_config=None))
        task = asyncio.create_task(fake.serve(sockets=[sock]))
        fake_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            async with (
                router("--backend", fake_url) as (url, app),
                httpx.AsyncClient(base_url=url, timeout=10) as http,
            ):
                await until(lambda: len(pool_of(app).ready()) == 1, "ready")
                # An encoded "?" stays in the path (decoded, it would start a query).
                seen = (await http.get("/v1/models%3Fa=b")).json()
                assert seen == {"raw_path": "/v1/models%3Fa=b", "query": ""}
                seen = (await http.get("/v1/x%2Fy/%C3%A9?q=%C3%A9&r")).json()
                assert seen == {"raw_path": "/v1/x%2Fy/%C3%A9", "query": "q=%C3%A9&r"}
                # A UTF-8 header value reaches the replica as the client's bytes.
                tenant = "café-€".encode()
                seen = (await http.get("/v1/models", headers={"x-tenant-id": tenant})).json()
                assert seen["tenant"] == tenant.hex()
                # The control app's 404 and 405, in OpenAI's shape as the proxied paths'.
                for method, path, code in [
                    ("GET", "/v1", 404), ("GET", "//v1/models", 404),
                    ("GET", "/tokenize/", 404), ("POST", "/health", 405),
                ]:  # fmt: skip
                    r = await http.request(method, path)
                    assert r.status_code == code, (path, r.text)
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                # "stream": 1 streams at a lenient replica: relayed as it comes, not buffered.
                start = time.perf_counter()
                body = {"prompt": "x", "stream": 1}
                async with http.stream("POST", "/v1/completions", json=body) as s:
                    chunks = s.aiter_raw()
                    assert (await chunks.__anext__()).startswith(b"data: 1")
                    assert time.perf_counter() - start < 0.8  # before the second event
                    rest = b"".join([c async for c in chunks])
                assert rest.endswith(b"data: [DONE]\n\n")
                # A replica's header outside latin-1 comes back as its bytes.
                r = await http.get("/v1/utf8-header")
                assert r.status_code == 200
                assert (b"x-request-id", "café-€".encode()) in r.headers.raw
                # A replica's redirect comes back to the client (the router followed it,
                # the body and the replicas' key sent wherever it pointed).
                r = await http.post("/v1/moved", json={"prompt": "x"})
                assert r.status_code == 307
                assert r.headers["location"] == "http://elsewhere.invalid/v1/x"
                # A bug in the proxy still answers in OpenAI's shape (and logs it).
                monkeypatch.setattr(decide, "_prefix_key", lambda body: 1 / 0)
                r = await http.post("/v1/completions", json={"prompt": "x"})
                assert r.status_code == 500
                assert r.json()["error"]["type"] == "internal_server_error"
                await until(lambda: pool_of(app).backends[fake_url].in_flight == 0, "zero")
                assert app.num_active == 0 and not app.proxy.active
        finally:
            fake.should_exit = True
            await task
            sock.close()

    asyncio.run(run())


def test_a_replica_failing_its_requests_after_each_readmission_backs_off_longer() -> None:
    """A replica whose /load answers while its generations fail: each good probe re-admits it
    and its next request fails; the backoff doubles each time (a fixed one would send a
    request there, to hang until its first-byte timeout, once per interval)."""
    from iterserve.router.pool import ReplicaPool

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return 200, b'{"kv_cache_usage": 0, "num_waiting": 0, "num_running": 0}'

    now = [0.0]
    pool = ReplicaPool(fetch, eject_after=3, clock=lambda: now[0])
    pool.set_urls(["http://r:1"])
    b = pool.backends["http://r:1"]

    async def run() -> None:
        await pool.poll(b)
        assert b.state.ready
        for _ in range(3):
            pool.record_failure(b, "timeout", request=True)
        assert b.ejected and b.backoff_s == 0.5
        waits = []
        for _ in range(7):
            now[0] = b.next_probe_at
            await pool.poll(b)  # /load answers: back
            assert b.state.ready and not b.ejected
            pool.record_failure(b, "timeout", request=True)  # its next request fails
            assert b.ejected
            waits.append(b.backoff_s)
        assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        # A good request ends the streak: a later ejection starts over at 0.5 s.
        now[0] = b.next_probe_at
        await pool.poll(b)
        pool.record_success_request(b)
        for _ in range(3):
            pool.record_failure(b, "timeout", request=True)
        assert b.ejected and b.backoff_s == 0.5

    asyncio.run(run())


class _ResetsRequests:
    """A vLLM-like replica whose polls answer (a high KV usage: picked last) and whose
    requests are reset before any status line."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        metrics = (
            b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
            b"vllm:kv_cache_usage_perc 0.9\n"
        )
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                request = conn.recv(65536)
                if request.startswith(b"GET "):
                    answer = metrics if request.startswith(b"GET /metrics ") else b""
                    status = b"200 OK" if answer else b"404 Not Found"
                    head = b"HTTP/1.1 %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                    conn.sendall(head % (status, len(answer)) + answer)
                else:
                    linger = b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)


def test_a_429_then_a_failed_retry_passes_the_429_through() -> None:
    """The first replica is full (429, Retry-After 7) and the retry's replica resets the
    connection: the client gets the 429 and its Retry-After (it got a 502)."""
    resets = _ResetsRequests()

    async def run() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        fake = uvicorn.Server(uvicorn.Config(_fake_replica(), log_config=None))
        task = asyncio.create_task(fake.serve(sockets=[sock]))
        full_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        flags = ("--backend", full_url, "--backend", resets.url, "--no-prefix-affinity")
        try:
            async with router(*flags) as (url, app), httpx.AsyncClient(timeout=10) as http:
                await until(lambda: len(pool_of(app).ready()) == 2, "both ready")
                r = await http.post(url + "/v1/chat/completions", json={"messages": []})
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "7"
                assert r.headers["x-routed-to"] == full_url
        finally:
            fake.should_exit = True
            await task
            sock.close()
            resets.sock.close()

    asyncio.run(run())
