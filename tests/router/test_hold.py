"""Scale from zero in the proxy mode (the endpoint picker's is in test_gateway.py): a request
arriving with no replica ready waits for one, within --hold-timeout-s and
--max-held-requests, and a client that leaves while held stops being held."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest
from router_utils import router, until
from server_utils import free_port, run_server
from sim_profiles import make_profile, write_profile


def _metric(text: str, line_start: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


def test_a_request_waits_for_the_first_replica(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "profile.json", make_profile())
    port = free_port()

    async def run() -> None:
        flags = ("--backend", f"http://127.0.0.1:{port}", "--hold-timeout-s", "30")
        async with router(*flags) as (url, app), httpx.AsyncClient(timeout=60) as http:
            decider = app.proxy.decider
            body = {"prompt": "first", "max_tokens": 2}
            request = asyncio.create_task(http.post(url + "/v1/completions", json=body))
            await until(lambda: decider.num_held == 1, "held")
            text = (await http.get(url + "/metrics")).text
            assert _metric(text, "iterserve_router_held_requests ") == 1
            with contextlib.ExitStack() as stack:
                replica = run_server("--simulate", str(profile), port=port)
                await asyncio.to_thread(stack.enter_context, replica)
                r = await request
                assert r.status_code == 200, r.text
                assert r.headers["x-routed-to"] == f"http://127.0.0.1:{port}"
            text = (await http.get(url + "/metrics")).text
            assert _metric(text, "iterserve_router_held_requests ") == 0
            assert _metric(text, 'iterserve_router_requests_total{code="held"') == 1
            assert _metric(text, 'iterserve_router_requests_total{code="503"') == 0

    asyncio.run(run())


def test_the_hold_is_bounded_in_time_and_in_number() -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        flags = ("--backend", dead, "--hold-timeout-s", "0.5", "--max-held-requests", "1")
        async with router(*flags) as (url, app), httpx.AsyncClient(timeout=10) as http:
            decider = app.proxy.decider
            body = {"prompt": "x", "max_tokens": 2}
            began = time.monotonic()
            held = asyncio.create_task(http.post(url + "/v1/completions", json=body))
            await until(lambda: decider.num_held == 1, "held")
            over = await http.post(url + "/v1/completions", json=body)  # past the bound
            assert over.status_code == 503 and over.headers["retry-after"] == "1"
            assert decider.num_held == 1  # answered at once, the first still held
            timed_out = await held
            assert timed_out.status_code == 503 and timed_out.headers["retry-after"] == "1"
            assert timed_out.json()["error"]["type"] == "service_unavailable_error"
            assert time.monotonic() - began >= 0.5
            assert decider.num_held == 0
            text = (await http.get(url + "/metrics")).text
            assert _metric(text, 'iterserve_router_requests_total{code="503"') == 2

    asyncio.run(run())


def test_a_client_leaving_while_held_is_held_no_more() -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        async with router("--backend", dead, "--hold-timeout-s", "30") as (url, app):
            decider = app.proxy.decider
            async with httpx.AsyncClient(timeout=0.5) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(url + "/v1/completions", json={"prompt": "x"})
            await until(lambda: decider.num_held == 0, "no longer held")
            assert app.num_active == 0

    asyncio.run(run())
