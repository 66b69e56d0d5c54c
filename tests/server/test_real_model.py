"""A real server on the real model, for what only the real engine shows: streamed text of
multi-byte characters, KV blocks freed on disconnect, live settings applied mid-stream by the
real scheduler, and swap preemption under memory pressure."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from server_utils import ADMIN_TOKEN, API_KEY, Server, run_server, stream_completion

pytestmark = pytest.mark.model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def load(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/load", timeout=10).json()  # type: ignore[no-any-return]


def wait_all_blocks_free(server: Server, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        state = load(server)
        if state["num_free_blocks"] == state["num_total_blocks"] and state["num_running"] == 0:
            return state
        assert time.monotonic() < deadline, f"blocks still held: {state}"
        time.sleep(0.05)


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not exported"
    return values[0]


@pytest.mark.parametrize(
    "content", ["Reply only with emojis: happy birthday", "请用中文介绍一下你自己。"]
)
def test_multibyte_stream_has_no_replacement_character(server: Server, content: str) -> None:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    deltas = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    deltas.append(choice["delta"].get("content", ""))
    text = "".join(deltas)
    full = httpx.post(
        server.url + "/v1/chat/completions",
        json={**body, "stream": False},
        headers=AUTH,
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert text == full and "\ufffd" not in text
    assert any(ord(c) > 0x2E80 for c in text), text


def test_streaming_disconnect_frees_blocks_within_a_second(server: Server) -> None:
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert load(server)["num_running"] == 1
    wait_all_blocks_free(server, within_s=1.0)


def test_non_streaming_disconnect_frees_blocks_within_a_second(server: Server) -> None:
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(
                http.post(server.url + "/v1/completions", json=body, headers=AUTH)
            )
            deadline = time.monotonic() + 30
            while (await http.get(server.url + "/load")).json()["num_running"] == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    wait_all_blocks_free(server, within_s=1.0)


def test_sixteen_streams_survive_two_config_changes(server: Server) -> None:
    """8 long streams run; max_num_seqs drops to 4 (nothing is dropped, 8 more wait); it rises
    to 16 (the waiting 8 are admitted at once, next to the first 8). The first 8 are long
    enough to outlive both changes (the raise lands ~10 tokens into them; they have 64)."""

    async def stream(http: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, list[str]]:
        body = {
            "prompt": f"Stream {i}: tell me about the sea.",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        result = await stream_completion(http, body, headers=AUTH)
        assert result.status == 200 and not result.errors, result
        return result.completion_tokens, result.finish_reasons

    async def until(http: httpx.AsyncClient, ok: Any, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 120
        while not ok(state := (await http.get("/load")).json()):
            assert time.monotonic() < deadline, f"{what}: {state}"
            await asyncio.sleep(0.02)
        return state  # type: ignore[no-any-return]

    async def main() -> tuple[list[Any], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            first = [asyncio.create_task(stream(http, i, 64)) for i in range(8)]
            await until(http, lambda s: s["num_running"] == 8, "8 running")
            r = await http.put("/admin/scheduler_config", json={"max_num_seqs": 4}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["max_num_seqs"] == 4
            second = [asyncio.create_task(stream(http, i, 16)) for i in range(8, 16)]
            lowered = await until(http, lambda s: s["num_waiting"] == 8, "8 waiting")
            assert lowered["num_running"] == 8 and lowered["max_num_seqs"] == 4
            r = await http.put(
                "/admin/scheduler_config",
                json={"max_num_seqs": 16, "max_num_batched_tokens": 128},
                headers=ADMIN,
            )
            assert r.status_code == 200
            raised = await until(http, lambda s: s["num_running"] > 8, "more admitted")
            return await asyncio.gather(*first, *second), [lowered, raised]

    original = httpx.get(server.url + "/admin/scheduler_config", headers=ADMIN).json()
    try:
        results, (_, raised) = asyncio.run(main())
        config = httpx.get(server.url + "/admin/scheduler_config", headers=ADMIN).json()
    finally:
        settings = {k: v for k, v in original.items() if k not in ("config_hash", "config_version")}
        httpx.put(server.url + "/admin/scheduler_config", json=settings, headers=ADMIN, timeout=60)
    expected = [64] * 8 + [16] * 8
    assert [n for n, _ in results] == expected
    assert all(f == ["length"] for _, f in results), results
    # The 8 waiting were admitted in one iteration, next to the 8 still running.
    assert raised["max_num_seqs"] == 16
    assert raised["num_running"] == 16 and raised["num_waiting"] == 0, raised
    assert config["max_num_seqs"] == 16 and config["max_num_batched_tokens"] == 128


def test_a_tenant_queued_behind_another_tenants_backlog_goes_next(server: Server) -> None:
    """One seat: tenant a queues five requests, then tenant b sends one. Fair share (the
    Virtual Token Counter) serves b as soon as a seat frees, not after a's backlog (arrival
    order would serve it sixth). The tenant travels from the X-Tenant-Id header and the
    `user` field to the engine's scheduler."""
    done: list[str] = []

    async def send(http: httpx.AsyncClient, name: str, tenant: dict[str, Any]) -> None:
        body = {"prompt": f"{name}: count to twenty.", "max_tokens": 12, "ignore_eos": True}
        r = await http.post("/v1/completions", json={**body, **tenant.get("json", {})},
                            headers={**AUTH, **tenant.get("headers", {})})  # fmt: skip
        assert r.status_code == 200, r.text
        done.append(name)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            backlog = [
                asyncio.create_task(send(http, f"a{i}", {"headers": {"X-Tenant-Id": "a"}}))
                for i in range(5)
            ]
            deadline = time.monotonic() + 60
            while (await http.get("/load")).json()["num_waiting"] < 4:
                assert time.monotonic() < deadline, "a's backlog never queued"
                await asyncio.sleep(0.005)
            await asyncio.gather(send(http, "b", {"json": {"user": "b"}}), *backlog)

    original = httpx.get(server.url + "/admin/scheduler_config", headers=ADMIN).json()
    r = httpx.put(server.url + "/admin/scheduler_config", json={"max_num_seqs": 1}, headers=ADMIN)
    assert r.status_code == 200, r.text
    try:
        asyncio.run(main())
    finally:
        settings = {k: v for k, v in original.items() if k not in ("config_hash", "config_version")}
        httpx.put(server.url + "/admin/scheduler_config", json=settings, headers=ADMIN, timeout=60)
    assert sorted(done) == ["a0", "a1", "a2", "a3", "a4", "b"]
    assert done.index("b") <= 2, done  # after the running one and at most one more of a's


def test_swap_preemption_under_kv_pressure_keeps_every_stream_whole() -> None:
    """A pool too small for the batch: the scheduler swaps requests out to host memory and
    back; /load shows them swapped, the metrics count swap preemptions, and every stream
    still delivers all its tokens."""
    with run_server(
        "--dtype", "float32", "--num-kv-blocks", "12", "--swap-space", "0.05",
        "--preemption-mode", "swap", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
    ) as server:  # fmt: skip
        seen_swapped = []

        async def main() -> list[Any]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                bodies = [
                    {"prompt": f"Story {i}: once upon a time", "max_tokens": 40, "ignore_eos": True}
                    for i in range(6)
                ]
                tasks = [asyncio.create_task(stream_completion(http, b)) for b in bodies]
                while not all(t.done() for t in tasks):
                    seen_swapped.append((await http.get("/load")).json()["num_swapped"])
                    await asyncio.sleep(0.01)
                return [t.result() for t in tasks]

        results = asyncio.run(main())
        assert [(r.status, r.completion_tokens, r.errors) for r in results] == [(200, 40, [])] * 6
        assert max(seen_swapped) > 0, "no request was ever swapped out"
        swaps = metric(server, 'iterserve_num_preemptions_total{mode="swap",reason="kv"}')
        assert swaps >= 1
        assert metric(server, 'iterserve_num_preemptions_total{mode="recompute",reason="kv"}') == 0
        assert metric(server, "iterserve_num_requests_swapped") == 0
        wait_all_blocks_free(server, within_s=5.0)
