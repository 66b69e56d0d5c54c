"""The router in front of simulated replicas (real servers over the simulated runner): load-
aware picks, streams passed through as they are written, fail-over, ejection and return,
hung replicas, 429s, no replica, a vLLM-style replica, keys, and in-flight counts."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from router_utils import all_idle, pool_of, router, until
from server_utils import Server, free_port, run_server, simulated_replicas
from sim_profiles import make_profile, write_profile

from iterserve.cli import build_parser
from iterserve.router.pool import replica_name
from iterserve.router.server import build

# 20 ms per iteration: streams take visible time, tests stay short.
PROFILE = make_profile(fixed_s=0.020)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_profile(tmp_path_factory.mktemp("router") / "profile.json", PROFILE)


def _backends(servers: list[Server]) -> list[str]:
    return [x for s in servers for x in ("--backend", s.url)]


def test_new_requests_go_to_the_idle_replica(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 2) as (busy, idle):

        async def run() -> None:
            # Reports stay fresh for 5 s: on a busy machine a poll can come late, and two stale
            # reports tie (both scored saturated), which is not what this test is about.
            flags = ("--no-prefix-affinity", "--stale-after-ms", "5000")
            async with router(*_backends([busy, idle]), *flags) as (url, app):
                pool = pool_of(app)
                await until(lambda: len(pool.ready()) == 2, "both replicas ready")
                async with httpx.AsyncClient(timeout=60) as http:
                    # Load one replica directly with long requests.
                    body = {"prompt": "x" * 400, "max_tokens": 400, "ignore_eos": True}
                    loaders = [
                        asyncio.create_task(http.post(busy.url + "/v1/completions", json=body))
                        for _ in range(6)
                    ]
                    report = lambda: pool.backends[busy.url].state.report  # noqa: E731
                    await until(lambda: report() and report().num_running == 6, "load seen")
                    answers = []
                    for i in range(6):
                        body = {"prompt": f"q{i}", "max_tokens": 2}
                        answers.append(await http.post(url + "/v1/completions", json=body))
                        # The next pick on a report taken after this answer: one taken while
                        # it was still queued scores the idle replica as busy until the next
                        # poll (the running count is not in the score), and a client this
                        # fast would then land on the busy one (seen once in a clean run).
                        await until(_reported_since(pool, idle.url), "a report after it")
                    assert all(a.status_code == 200 for a in answers)
                    counts = _requests_by_replica(await http.get(url + "/metrics"))
                    assert counts == {replica_name(idle.url): 6}, counts
                    for t in loaders:
                        t.cancel()
                await until(lambda: all(b.in_flight == 0 for b in pool.backends.values()), "zero")

        asyncio.run(run())


def _reported_since(pool: Any, url: str) -> Callable[[], bool]:
    """Whether ``url``'s replica has reported since now (the router's clock)."""
    now = pool.clock()
    return lambda: pool.backends[url].state.report.received_at > now


def _requests_by_replica(response: httpx.Response) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in response.text.splitlines():
        if line.startswith("iterserve_router_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="')[1].split('"')[0]
            if float(value):  # the none/503 series exists at 0 from the start
                counts[replica] = counts.get(replica, 0) + int(float(value))
    return counts


def test_streams_pass_through_as_they_are_written(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 1) as (only,):

        async def stamps(http: httpx.AsyncClient, base: str) -> list[float]:
            body = {"prompt": "stream me", "max_tokens": 10, "ignore_eos": True, "stream": True}
            out = []
            async with http.stream("POST", base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        out.append(time.perf_counter())
            return out

        async def run() -> None:
            async with router(*_backends([only])) as (url, app):
                await until(lambda: len(pool_of(app).ready()) == 1, "ready")
                async with httpx.AsyncClient(timeout=30) as http:
                    direct, routed = await stamps(http, only.url), await stamps(http, url)
            assert len(direct) == len(routed) == 10
            # Events spread over ~9 iterations of >= 21 ms, through the router as direct.
            assert routed[-1] - routed[0] >= 0.8 * (direct[-1] - direct[0]) >= 0.8 * 9 * 0.021

        asyncio.run(run())


def test_a_dead_replica_is_ejected_and_readmitted(profile_file: Path) -> None:
    port = free_port()
    with simulated_replicas(profile_file, 1) as (alive,):

        async def run() -> None:
            dead_url = f"http://127.0.0.1:{port}"
            async with router("--backend", alive.url, "--backend", dead_url) as (url, app):
                pool = pool_of(app)
                await until(lambda: pool.backends[dead_url].ejected, "the dead one ejected")
                async with httpx.AsyncClient(timeout=30) as http:
                    for i in range(6):
                        r = await http.post(
                            url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}
                        )
                        assert r.status_code == 200
                    assert (await http.get(url + "/load")).json()["num_ready_replicas"] == 1
                    # It comes back: a probe re-admits it.
                    revived = run_server("--simulate", str(profile_file), port=port)
                    await asyncio.to_thread(revived.__enter__)
                    try:
                        await until(lambda: pool.backends[dead_url].state.ready, "re-admitted", 40)
                        assert (await http.get(url + "/load")).json()["num_ready_replicas"] == 2
                    finally:
                        await asyncio.to_thread(revived.__exit__, None, None, None)
                    await until(lambda: not pool.backends[dead_url].state.ready, "gone again")
                    r = await http.post(
                        url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}
                    )
                    assert r.status_code == 200
                assert all(b.in_flight == 0 for b in pool.backends.values())

        asyncio.run(run())


class _Silent:
    """A TCP server that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def test_a_replica_that_never_answers_cannot_stall_the_router(profile_file: Path) -> None:
    silent = _Silent()
    with simulated_replicas(profile_file, 1) as (alive,):

        async def run() -> None:
            flags = ("--backend", silent.url, "--backend", alive.url, "--first-byte-timeout-s", "1")
            async with router(*flags, "--policy", "round_robin") as (url, app):
                pool = pool_of(app)
                # The silent one never reports, so it never turns ready; force it in, as a
                # replica that hangs after its last good poll would be.
                await until(lambda: pool.backends[alive.url].state.ready, "alive ready")
                pool.backends[silent.url].state.ready = True
                async with httpx.AsyncClient(timeout=30) as http:
                    start = time.perf_counter()
                    body = {"prompt": "hung?", "max_tokens": 2}
                    results = await asyncio.gather(
                        *(http.post(url + "/v1/completions", json=body) for _ in range(4))
                    )
                    assert [r.status_code for r in results] == [200] * 4
                    assert time.perf_counter() - start < 5
                    retries = [
                        line for line in (await http.get(url + "/metrics")).text.splitlines()
                        if line.startswith('iterserve_router_retries_total{reason="timeout"}')
                    ]  # fmt: skip
                    assert float(retries[0].split()[-1]) >= 1
                assert all(b.in_flight == 0 for b in pool.backends.values())

        asyncio.run(run())
    silent.close()


def test_no_ready_replica_is_a_503_with_retry_after() -> None:
    async def run() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        flags = ("--backend", dead, "--hold-timeout-s", "0")
        async with router(*flags) as (url, _), httpx.AsyncClient(timeout=10) as http:
            r = await http.post(url + "/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "service_unavailable_error"
            assert (await http.get(url + "/ready")).status_code == 503
            assert (await http.get(url + "/health")).status_code == 200

    asyncio.run(run())


def test_a_full_replica_passes_the_request_on_and_429_comes_through_last(
    profile_file: Path,
) -> None:
    flags = ("--max-waiting", "1", "--max-num-seqs", "1")
    with simulated_replicas(profile_file, 2, *flags) as servers:

        async def run() -> None:
            async with router(*_backends(servers), "--no-prefix-affinity") as (url, app):
                await until(lambda: len(pool_of(app).ready()) == 2, "ready")
                async with httpx.AsyncClient(timeout=60) as http:
                    body = {"prompt": "y" * 40, "max_tokens": 60, "ignore_eos": True}
                    results = await asyncio.gather(
                        *(http.post(url + "/v1/completions", json=body) for _ in range(12))
                    )
                    metrics = (await http.get(url + "/metrics")).text.splitlines()
                codes = [r.status_code for r in results]
                # Each replica queues one request at a time (max_waiting 1 counts it until its
                # first token), so a burst of 12 is mostly refused: every final 429 was first
                # passed on to the other replica, and comes back with Retry-After.
                assert set(codes) == {200, 429} and codes.count(429) >= 4
                assert all("retry-after" in r.headers for r in results if r.status_code == 429)
                served = [m for m in metrics if m.startswith("iterserve_router_requests_total")]
                assert len([m for m in served if 'code="200"' in m]) == 2  # both took work
                retried = [m for m in metrics if 'retries_total{reason="status_429"}' in m]
                assert float(retried[0].split()[-1]) >= codes.count(429)
                assert all(b.in_flight == 0 for b in pool_of(app).backends.values())

        asyncio.run(run())


def _vllm_like(waiting: int, usage: float) -> FastAPI:
    app = FastAPI()
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n'
    )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(text)

    @app.post("/v1/completions")
    async def completions() -> dict[str, str]:
        return {"served_by": "vllm-like"}

    return app


def test_vllm_style_replicas_are_scored_from_their_metrics(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 1) as (ours,):

        async def run() -> None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            fake = uvicorn.Server(uvicorn.Config(_vllm_like(0, 0.05), log_config=None))
            task = asyncio.create_task(fake.serve(sockets=[sock]))
            fake_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            try:
                async with router("--backend", ours.url, "--backend", fake_url) as (url, app):
                    pool = pool_of(app)
                    await until(lambda: len(pool.ready()) == 2, "both ready")
                    b = pool.backends[fake_url]
                    assert b.kind == "vllm" and pool.backends[ours.url].kind == "iterserve"
                    assert b.state.report.kv_cache_usage == pytest.approx(0.05)
                    assert b.state.report.num_running == 3
                    # Fill ours (KV ~40%): the vLLM-like one, at 5% by its metrics, wins.
                    async with httpx.AsyncClient(timeout=60) as http:
                        body = {"prompt": "x" * 1600, "max_tokens": 300, "ignore_eos": True}
                        loaders = [
                            asyncio.create_task(http.post(ours.url + "/v1/completions", json=body))
                            for _ in range(4)
                        ]
                        mine = pool.backends[ours.url].state
                        await until(
                            lambda: mine.report.kv_cache_usage > 0.3, "ours reports its load"
                        )
                        r = await http.post(url + "/v1/completions", json={"prompt": "z"})
                        assert r.json() == {"served_by": "vllm-like"}
                        for t in loaders:
                            t.cancel()
            finally:
                fake.should_exit = True
                await task
                sock.close()

        asyncio.run(run())


def test_router_keys(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 1, "--api-key", "replica-key") as (only,):

        async def run() -> None:
            flags = ("--backend", only.url, "--api-key", "router-key")
            async with router(*flags, "--backend-api-key", "replica-key") as (url, app):
                await until(lambda: len(pool_of(app).ready()) == 1, "ready")
                async with httpx.AsyncClient(timeout=10) as http:
                    body = {"prompt": "k", "max_tokens": 2}
                    assert (await http.post(url + "/v1/completions", json=body)).status_code == 401
                    auth = {"Authorization": "Bearer router-key"}
                    ok = await http.post(url + "/v1/completions", json=body, headers=auth)
                    assert ok.status_code == 200
                    tokens = await http.post(
                        url + "/tokenize", json={"prompt": "abcdefgh"}, headers=auth
                    )
                    assert tokens.status_code == 200 and len(tokens.json()["tokens"]) == 2
                    models = await http.get(url + "/v1/models", headers=auth)
                    assert models.json()["data"][0]["id"] == "Test-Model"

        asyncio.run(run())


def test_flags_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in (["router"], ["router", "--backend", "http://a:1", "--k8s-service", "s"]):
        args = build_parser().parse_args(argv)
        with pytest.raises(ValueError, match="--backend"):
            build(args)
    for argv, message in [
        (["--backend", "foo"], "http://host:port"),
        (["--backend", "ftp://a:1"], "http://host:port"),
        (["--backend", "http://a:99999"], "--backend"),
        (["--backend", "http://a:1", "--read-timeout-s", "0"], "read-timeout-s"),
        (["--backend", "http://a:1", "--poll-interval-ms", "-5"], "poll-interval-ms"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(build_parser().parse_args(["router", *argv]))
    # No cluster configuration: an error at start, not a router that is never ready.
    monkeypatch.setattr(
        "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", "/nonexistent"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="no Kubernetes configuration"):
        build(build_parser().parse_args(["router", "--k8s-service", "llm"]))


def test_prefix_affinity_keeps_each_prefix_on_its_two_replicas(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 4, "--simulate-speed", "4") as servers:

        async def run() -> None:
            async with router(*_backends(servers)) as (url, app):
                await until(lambda: len(pool_of(app).ready()) == 4, "ready")
                prompts = [(p, f"system prompt {p}: " + "be helpful. " * 60) for p in range(8)]
                homes: dict[int, list[str]] = {}
                served: dict[str, int] = {}
                async with httpx.AsyncClient(timeout=60) as http:

                    async def one(p: int, prefix: str, i: int) -> None:
                        body = {"prompt": prefix + f" question {i}", "max_tokens": 4}
                        r = await http.post(url + "/v1/completions", json=body)
                        assert r.status_code == 200
                        replica = r.headers["x-routed-to"]
                        homes.setdefault(p, []).append(replica)
                        served[replica] = served.get(replica, 0) + 1

                    for i in range(5):  # rounds of 8 concurrent requests, one per prefix
                        # A report taken while the last round ran would count its requests
                        # as load and pass prefixes on past the bound: wait for idle ones.
                        await until(lambda: all_idle(app), "idle replicas reported")
                        await asyncio.gather(*(one(p, prefix, i) for p, prefix in prompts))
            # Each prefix on the first two replicas of its ring walk (two choices), at most.
            assert all(len(set(h)) <= 2 for h in homes.values()), homes
            assert len(served) == 4 and max(served.values()) <= 15, served  # 40 requests

        asyncio.run(run())


def test_a_replica_killed_mid_run(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 2) as (victim, survivor):

        async def run() -> None:
            flags = (*_backends([victim, survivor]), "--policy", "round_robin")
            async with router(*flags) as (url, app), httpx.AsyncClient(timeout=30) as http:
                pool = pool_of(app)
                await until(lambda: len(pool.ready()) == 2, "ready")
                body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True}

                async def stream() -> bytes:
                    got = b""
                    async with http.stream("POST", url + "/v1/completions", json=body) as r:
                        with contextlib.suppress(httpx.HTTPError):
                            async for chunk in r.aiter_raw():
                                got += chunk
                    return got

                running = [asyncio.create_task(stream()) for _ in range(4)]
                victim_state = pool.backends[victim.url].state
                await until(
                    lambda: (
                        victim_state.report is not None and victim_state.report.num_running == 2
                    ),
                    "the victim streams two",
                )
                await asyncio.sleep(0.2)  # their first chunks have reached the clients
                victim.proc.kill()
                victim.proc.wait()
                outs = await asyncio.gather(*running)  # cut streams end (begun: no retry)
                # The victim's two streams end with an error event, the others with [DONE].
                assert sum(b"went away" in o for o in outs) == 2
                assert sum(o.rstrip().endswith(b"data: [DONE]") for o in outs) == 2
                short = {"prompt": "after the kill", "max_tokens": 2}
                answers = [await http.post(url + "/v1/completions", json=short) for _ in range(6)]
                assert [a.status_code for a in answers] == [200] * 6
                assert {a.headers["x-routed-to"] for a in answers} == {survivor.url}
                await until(lambda: pool.backends[victim.url].ejected, "the dead one ejected")
                assert all(b.in_flight == 0 for b in pool.backends.values())

        asyncio.run(run())


def test_a_client_leaving_the_router_aborts_the_replica_request(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 1) as (only,):

        async def run() -> None:
            async with (
                router(*_backends([only])) as (url, app),
                httpx.AsyncClient(timeout=30) as http,
            ):
                pool = pool_of(app)
                await until(lambda: len(pool.ready()) == 1, "ready")
                body = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True}

                async def leave_streamed() -> None:
                    headers = {"X-Request-Id": "client-chosen-id"}
                    streamed = {**body, "stream": True}
                    async with http.stream(
                        "POST", url + "/v1/completions", json=streamed, headers=headers
                    ) as r:
                        async for chunk in r.aiter_raw():
                            # The replica's request id comes through, as its chunks do.
                            assert r.headers["x-request-id"].encode() in chunk
                            break  # the first chunk, then hang up

                async def leave_whole() -> None:
                    with contextlib.suppress(httpx.TimeoutException):
                        await http.post(url + "/v1/completions", json=body, timeout=0.3)

                await asyncio.gather(leave_streamed(), leave_whole())
                replica = lambda: httpx.get(only.url + "/load").json()  # noqa: E731
                await until(lambda: replica()["num_running"] == 0, "both aborted at the replica")
                assert replica()["num_free_blocks"] == replica()["num_total_blocks"]
                await until(lambda: pool.backends[only.url].in_flight == 0, "router let go")

        asyncio.run(run())


class _Hangup:
    """A TCP server that reads a request and closes the connection without answering."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with contextlib.suppress(OSError):
                conn.recv(65536)
                conn.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            conn.close()  # a reset: no status line at all


def test_a_replica_resetting_connections_is_retried_and_ejected(profile_file: Path) -> None:
    hangup = _Hangup()
    with simulated_replicas(profile_file, 1) as (alive,):

        async def run() -> None:
            flags = ("--backend", hangup.url, "--backend", alive.url, "--policy", "round_robin")
            async with router(*flags) as (url, app), httpx.AsyncClient(timeout=30) as http:
                pool = pool_of(app)
                await until(lambda: pool.backends[alive.url].state.ready, "alive ready")
                pool.backends[hangup.url].state.ready = True  # as if its /load still answered
                body = {"prompt": "reset?", "max_tokens": 2}
                answers = [await http.post(url + "/v1/completions", json=body) for _ in range(6)]
                assert [a.status_code for a in answers] == [200] * 6
                assert {a.headers["x-routed-to"] for a in answers} == {alive.url}
                assert pool.backends[hangup.url].ejected  # requests failing eject it too
                # Bodies over the limit and paths out of /v1 are refused at the router.
                big = await http.post(url + "/v1/completions", content=b"x" * (5 << 20))
                assert big.status_code == 413
                escape = await http.get(url + "/v1/%2e%2e/version")
                assert escape.status_code == 404

        asyncio.run(run())
    hangup.sock.close()


def test_sigterm_drains_the_router(profile_file: Path) -> None:
    """First SIGTERM: /ready 503 (the router's Service stops sending), /health 200, the open
    stream runs to its end and new requests are still served; then the router exits 0."""
    with (
        simulated_replicas(profile_file, 1) as (replica,),
        run_server(*_backends([replica]), "--poll-interval-ms", "20", command="router") as r,
    ):

        async def run() -> None:
            async with httpx.AsyncClient(base_url=r.url, timeout=60) as http:
                body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
                events: list[str] = []
                async with http.stream("POST", "/v1/completions", json=body) as s:
                    async for line in s.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line)
                        if len(events) == 2:
                            r.proc.send_signal(signal.SIGTERM)
                            await asyncio.sleep(0.3)  # the signal has been handled
                            ready = await http.get("/ready")
                            assert ready.status_code == 503, ready.text
                            assert ready.json()["status"] == "draining"
                            assert (await http.get("/health")).status_code == 200
                            late = {"prompt": "late", "max_tokens": 2}
                            answer = await http.post("/v1/completions", json=late)
                            assert answer.status_code == 200, answer.text
                            assert r.proc.poll() is None
                assert events[-1] == "data: [DONE]"
                assert len(events) == 51  # 50 tokens, none lost

        asyncio.run(run())
        assert r.proc.wait(15) == 0
        assert "drained; shutting down" in r.log_text()
