"""The live push against pods that misbehave (an aiohttp app plays them, one path prefix per
pod): whatever a pod answers becomes that pod's error, never an exception; a redirect is
not followed (the admin token goes to the pod only); a slow pod is bounded by the timeout
and holds no other; more pods than aiohttp's default connection pool are all reached."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from iterserve.operator.push import PodTarget, ready_targets, sync_pods

HASH = "desired-hash"
SETTINGS: dict[str, Any] = {"max_num_seqs": 8}


async def _pods(behaviours: dict[str, Any]) -> tuple[web.AppRunner, str, list[str]]:
    """An app serving ``/{pod}/load`` and ``/{pod}/admin/scheduler_config`` per behaviour;
    its base URL; the paths a redirect led to (must stay empty)."""
    followed: list[str] = []

    async def load(request: web.Request) -> web.StreamResponse:
        return await behaviours[request.match_info["pod"]]("load", request)

    async def put(request: web.Request) -> web.StreamResponse:
        return await behaviours[request.match_info["pod"]]("put", request)

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        followed.append(request.path)
        return web.json_response({"config_hash": HASH, "config_version": 1})

    app = web.Application()
    app.router.add_get("/{pod}/load", load)
    app.router.add_put("/{pod}/admin/scheduler_config", put)
    app.router.add_route("*", "/elsewhere/{tail:.*}", elsewhere)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", followed


async def good(step: str, request: web.Request) -> web.StreamResponse:
    if step == "load":
        return web.json_response({"config_hash": "old", "config_version": 1})
    return web.json_response({"config_hash": HASH, "config_version": 2})


def test_misbehaving_pods_are_errors_not_exceptions() -> None:
    async def answer(body: bytes, status: int = 200) -> web.Response:
        return web.Response(body=body, status=status, content_type="application/json")

    async def load_list(step: str, request: web.Request) -> web.StreamResponse:
        return await answer(b"[1, 2]")

    async def load_garbage(step: str, request: web.Request) -> web.StreamResponse:
        return await answer(b"\xff not json")

    async def load_null_version(step: str, request: web.Request) -> web.StreamResponse:
        return await answer(b'{"config_hash": "desired-hash", "config_version": "seven"}')

    async def redirect(step: str, request: web.Request) -> web.StreamResponse:
        if step == "load":
            return await good(step, request)
        raise web.HTTPTemporaryRedirect("/elsewhere/admin/scheduler_config")

    async def redirect_load(step: str, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/elsewhere/load")

    async def unauthorized_string(step: str, request: web.Request) -> web.StreamResponse:
        if step == "load":
            return await good(step, request)
        return await answer(b'{"error": "unauthorized"}', 401)

    async def unauthorized_html(step: str, request: web.Request) -> web.StreamResponse:
        if step == "load":
            return await good(step, request)
        return web.Response(text="<html>401</html>", status=401, content_type="text/html")

    async def put_list(step: str, request: web.Request) -> web.StreamResponse:
        if step == "load":
            return await good(step, request)
        return await answer(b"[]")

    async def scenario() -> None:
        behaviours = {
            "good": good,
            "list": load_list,
            "garbage": load_garbage,
            "odd-version": load_null_version,
            "redirect": redirect,
            "redirect-load": redirect_load,
            "401-string": unauthorized_string,
            "401-html": unauthorized_html,
            "put-list": put_list,
        }
        runner, base, followed = await _pods(behaviours)
        try:
            pods = [PodTarget(name, f"{base}/{name}") for name in behaviours]
            results = {r.name: r for r in await sync_pods(pods, SETTINGS, HASH, 2, "t", 5.0)}
        finally:
            await runner.cleanup()
        assert followed == []
        good_result = results.pop("good")
        assert (good_result.applied, good_result.pushed, good_result.version) == (True, True, 2)
        odd = results.pop("odd-version")
        assert (odd.applied, odd.version, odd.error) == (True, None, None)
        for name, result in results.items():
            assert not result.applied and result.error, (name, result)
        assert "401: unauthorized" in results["401-string"].error  # type: ignore[operator]
        assert results["401-html"].error.startswith("401: <html>")  # type: ignore[union-attr]
        assert "307" in results["redirect"].error  # type: ignore[operator]
        assert "302" in results["redirect-load"].error  # type: ignore[operator]

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_slow_pod_holds_no_other_and_many_pods_are_all_reached() -> None:
    busy_pods = 150  # beyond aiohttp's default pool of 100 connections
    arrived = 0
    all_arrived = asyncio.Event()

    async def slow(step: str, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(60)
        return await good(step, request)

    async def busy(step: str, request: web.Request) -> web.StreamResponse:
        # A barrier, not a sleep: no busy pod answers its GET until every busy pod's GET is
        # open at once. With a pool limit, pods beyond it never get a connection, the barrier
        # never opens and every busy pod times out; the result does not hang on CPU speed.
        nonlocal arrived
        if step == "load":
            arrived += 1
            if arrived == busy_pods:
                all_arrived.set()
            await all_arrived.wait()
        return await good(step, request)

    async def scenario() -> None:
        runner, base, _ = await _pods({"slow": slow, "busy": busy})
        try:
            pods = [PodTarget("slow", f"{base}/slow")]
            pods += [PodTarget(f"busy-{i}", f"{base}/busy") for i in range(busy_pods)]
            start = time.monotonic()
            results = await sync_pods(pods, SETTINGS, HASH, 2, "t", timeout_s=4.0)
            elapsed = time.monotonic() - start
        finally:
            await runner.cleanup()
        assert elapsed < 12, elapsed  # the slow pod's GET is cut at 4 s, not held for 60
        slow_result, *busy_results = results
        assert not slow_result.applied and "Timeout" in (slow_result.error or "")
        assert all(r.applied for r in busy_results), [r for r in busy_results if not r.applied]

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_ready_targets_brackets_ipv6_addresses() -> None:
    pod = {
        "metadata": {"name": "v6"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": "fd00::12", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert ready_targets([pod]) == [PodTarget("v6", "http://[fd00::12]:8000")]
