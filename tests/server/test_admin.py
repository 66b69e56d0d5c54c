"""Live scheduler settings over ``/admin/scheduler_config`` on a real server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import ADMIN_TOKEN, API_KEY, Server, stream_completion

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def get_config(server: Server) -> dict[str, Any]:
    r = httpx.get(server.url + "/admin/scheduler_config", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def put_config(server: Server, body: Any, status: int = 200) -> dict[str, Any]:
    r = httpx.put(server.url + "/admin/scheduler_config", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == status, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture
def restore(server: Server) -> Iterator[None]:
    original = get_config(server)
    yield
    settings = {k: v for k, v in original.items() if k not in ("config_version", "config_hash")}
    put_config(server, settings)


def test_get_shows_the_live_settings(server: Server) -> None:
    config = get_config(server)
    assert config["max_num_seqs"] == 32 and config["max_num_batched_tokens"] == 256
    assert [t["name"] for t in config["tiers"]] == ["premium", "standard", "best-effort"]
    assert len(config["config_hash"]) == 64 and config["config_version"] >= 1


def test_admin_auth(server: Server) -> None:
    url = server.url + "/admin/scheduler_config"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(url, headers=AUTH).status_code == 401  # the API key is not the admin token


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"block_size": 32}, "cannot change while the server runs"),
        ({"dtype": "bfloat16"}, "cannot change while the server runs"),
        ({"max_model_len": 128}, "cannot change while the server runs"),
        ({"swap_space": 1.0}, "cannot change while the server runs"),
        ({"max_num_sequences": 4}, "unknown settings"),
        ({"max_num_seqs": 300}, "must be >= max_num_seqs"),
        ({"long_prefill_token_threshold": 1000}, "long_prefill_token_threshold"),
        ({"kv_watermark": 1.5}, "kv_watermark"),
        ({"preemption_mode": "swap"}, "swap space"),
        ({"preemption_mode": "teleport"}, "preemption_mode"),
        ({"max_num_seqs": "many"}, "integer"),
        ({"tiers": [{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]}, "unique"),
        ({"tiers": [{"name": "a", "level": 0}]}, "bad tier"),
        ({"config_version": "seven"}, "config_version"),
        ({"config_version": 10**30}, "config_version"),
        ({"aging_interval_s": 5e-324}, "aging_interval_s"),
        ({"tiers": [{"name": "a", "priority": 0, "max_queue_wait_ms": -5}]}, "max_queue_wait_ms"),
        ([1, 2], "JSON object"),
    ],
)
def test_put_rejects_with_422_and_a_reason(server: Server, body: Any, reason: str) -> None:
    before = get_config(server)
    error = put_config(server, body, status=422)["error"]
    assert reason in error["message"], error
    assert get_config(server) == before  # nothing changed


def test_put_merges_versions_and_noops(server: Server, restore: None) -> None:
    before = get_config(server)
    after = put_config(server, {"aging_interval_s": 2.5})
    assert after["aging_interval_s"] == 2.5 and after["max_num_seqs"] == before["max_num_seqs"]
    assert after["config_version"] == before["config_version"] + 1
    assert after["config_hash"] != before["config_hash"]
    assert put_config(server, {"aging_interval_s": 2.5}) == after  # same values: a no-op
    adopted = put_config(server, {"kv_watermark": 0.02, "config_version": 1000})
    assert adopted["config_version"] == 1000  # the operator's generation is adopted
    older = put_config(server, {"kv_watermark": 0.03, "config_version": 5})
    assert older["config_version"] == 1001
    same = put_config(server, {**{k: v for k, v in older.items()}})  # GET echoed back
    assert same == older
    assert httpx.get(server.url + "/load").json()["config_version"] == 1001
    metrics = httpx.get(server.url + "/metrics").text
    assert "iterserve_scheduler_config_version 1001.0" in metrics


def test_tier_changes_apply_to_the_next_arrivals(server: Server, restore: None) -> None:
    tiers = [{"name": "gold", "priority": 0}, {"name": "bronze", "priority": 3}]
    put_config(server, {"tiers": tiers})
    # Without a priority a request goes to "standard", or, once there is no such tier, to
    # the least urgent one.
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200
    assert (
        'iterserve_e2e_request_latency_seconds_count{tier="bronze"} 1.0'
        in httpx.get(server.url + "/metrics").text
    )
    body = {"prompt": "Hi", "max_tokens": 2, "priority": "gold"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    body["priority"] = "premium"
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "gold" in r.json()["error"]["message"]


def test_sixteen_streams_survive_two_config_changes(server: Server, restore: None) -> None:
    """8 long streams run; max_num_seqs drops to 4 (nothing is dropped, 8 more wait); it rises
    to 16 (the waiting 8 are admitted at once, next to the first 8)."""

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
            first = [asyncio.create_task(stream(http, i, 400)) for i in range(8)]
            await until(http, lambda s: s["num_running"] == 8, "8 running")
            r = await http.put("/admin/scheduler_config", json={"max_num_seqs": 4}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["max_num_seqs"] == 4
            second = [asyncio.create_task(stream(http, i, 48)) for i in range(8, 16)]
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

    results, (_, raised) = asyncio.run(main())
    expected = [400] * 8 + [48] * 8
    assert [n for n, _ in results] == expected
    assert all(f == ["length"] for _, f in results), results
    assert raised["max_num_seqs"] == 16 and raised["num_running"] <= 16
    config = get_config(server)
    assert config["max_num_seqs"] == 16 and config["max_num_batched_tokens"] == 128
    metrics = httpx.get(server.url + "/metrics").text
    assert f"iterserve_scheduler_config_version {float(config['config_version'])}" in metrics


def test_absurdly_nested_body_is_400(server: Server) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    r = httpx.put(server.url + "/admin/scheduler_config", content=body, headers=ADMIN)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
