"""Live scheduler settings over ``/admin/scheduler_config``, over a fake engine client (the
real engine applying them mid-stream is tested in test_real_model.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_engine import FakeEngineClient, run_with_server

from iterserve.config import ServerConfig

ADMIN_TOKEN = "admin-fake"
API_KEY = "sk-fake"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONFIG = ServerConfig(api_key=API_KEY, admin_token=ADMIN_TOKEN)
URL = "/admin/scheduler_config"


async def get_config(http: httpx.AsyncClient) -> dict[str, Any]:
    r = await http.get(URL, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def put_config(http: httpx.AsyncClient, body: Any, status: int = 200) -> dict[str, Any]:
    r = await http.put(URL, json=body, headers=ADMIN)
    assert r.status_code == status, r.text
    return r.json()  # type: ignore[no-any-return]


def test_get_shows_the_live_settings_and_needs_the_admin_token(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        config = await get_config(http)
        assert config["max_num_seqs"] == 32 and config["max_num_batched_tokens"] == 512
        assert [t["name"] for t in config["tiers"]] == ["premium", "standard", "best-effort"]
        assert len(config["config_hash"]) == 64 and config["config_version"] == 1
        assert (await http.get(URL)).status_code == 401
        assert (await http.get(URL, headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await http.get(URL, headers=AUTH)).status_code == 401  # the key is not the token

    run_with_server(tokenizer, check, CONFIG)


def test_without_an_admin_token_the_admin_api_is_403_saying_how_to_enable_it(
    tokenizer: Any,
) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        r = await http.get(URL)
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "permission_error"

    run_with_server(tokenizer, check, ServerConfig())


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"block_size": 32}, "cannot change while the server runs"),
        ({"dtype": "bfloat16"}, "cannot change while the server runs"),
        ({"max_model_len": 128}, "cannot change while the server runs"),
        ({"swap_space": 1.0}, "cannot change while the server runs"),
        ({"max_num_sequences": 4}, "unknown settings"),
        ({"max_num_seqs": 600}, "must be >= max_num_seqs"),
        ({"long_prefill_token_threshold": 1000}, "long_prefill_token_threshold"),
        ({"kv_watermark": 1.5}, "kv_watermark"),
        ({"preemption_mode": "swap"}, "swap space"),
        ({"preemption_mode": "teleport"}, "preemption_mode"),
        ({"max_num_seqs": "many"}, "integer"),
        ({"tiers": [{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]}, "unique"),
        ({"tiers": [{"name": "a", "level": 0}]}, "bad tier"),
        ({"tiers": [{"name": "a\u0007\nb", "priority": 0}]}, "printable characters"),
        ({"tiers": [{"name": "t" * 64, "priority": 0}]}, "at most 63"),
        ({"config_version": "seven"}, "config_version"),
        ({"config_version": 10**30}, "config_version"),
        ({"aging_interval_s": 5e-324}, "aging_interval_s"),
        ({"priority_preemption_margin": -1}, "priority_preemption_margin must be in"),
        ({"priority_preemption_margin": 10**25}, "priority_preemption_margin must be in"),
        ({"priority_preemption_margin": 0.5}, "integer"),
        ({"tiers": [{"name": "a", "priority": 0, "max_queue_wait_ms": -5}]}, "max_queue_wait_ms"),
        ({"tiers": [{"name": "a", "priority": 10**400}]}, "(-2**53, 2**53)"),
        ({"max_num_batched_tokens": 2**70}, "below 2**53"),  # killed the telemetry writer
        ({"max_waiting": 2**63, "max_waiting_per_tenant": None}, "below 2**53"),
        ([1, 2], "JSON object"),
    ],
)
def test_put_rejects_with_422_and_a_reason(tokenizer: Any, body: Any, reason: str) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        before = await get_config(http)
        error = (await put_config(http, body, status=422))["error"]
        assert reason in error["message"] and error["code"] == "invalid_config", error
        assert await get_config(http) == before  # nothing changed
        assert fake.config_updates == []  # nothing reached the engine

    run_with_server(tokenizer, check, CONFIG)


def test_put_merges_versions_noops_and_reaches_the_engine(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        before = await get_config(http)
        after = await put_config(http, {"aging_interval_s": 2.5})
        assert after["aging_interval_s"] == 2.5 and after["max_num_seqs"] == before["max_num_seqs"]
        assert after["config_version"] == 2 and after["config_hash"] != before["config_hash"]
        assert fake.config_updates[-1].aging_interval_s == 2.5
        assert await put_config(http, {"aging_interval_s": 2.5}) == after  # same: a no-op
        assert len(fake.config_updates) == 1
        adopted = await put_config(http, {"kv_watermark": 0.02, "config_version": 1000})
        assert adopted["config_version"] == 1000  # the operator's generation is adopted
        older = await put_config(http, {"kv_watermark": 0.03, "config_version": 5})
        assert older["config_version"] == 1001
        assert await put_config(http, older) == older  # GET echoed back: a no-op
        assert [c.kv_watermark for c in fake.config_updates] == [0.01, 0.02, 0.03]
        assert (await http.get("/load")).json()["config_version"] == 1001
        assert "iterserve_scheduler_config_version 1001.0" in (await http.get("/metrics")).text

    run_with_server(tokenizer, check, CONFIG)


def test_put_priority_preemption_margin_reaches_the_engine(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        assert (await get_config(http))["priority_preemption_margin"] == 1  # on by default
        after = await put_config(http, {"priority_preemption_margin": 0})
        assert after["priority_preemption_margin"] == 0
        assert fake.config_updates[-1].priority_preemption_margin == 0

    run_with_server(tokenizer, check, CONFIG)


def test_tier_changes_apply_to_the_next_arrivals(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        tiers = [{"name": "gold", "priority": 0}, {"name": "bronze", "priority": 3}]
        await put_config(http, {"tiers": tiers})
        # Without a priority a request goes to "standard", or, once there is no such tier, to
        # the least urgent one.
        body: dict[str, Any] = {"prompt": "Hi", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
        body["priority"] = "gold"
        assert (await http.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
        assert [a.priority for a in fake.added] == [3, 0]
        metrics = (await http.get("/metrics")).text
        assert 'iterserve_e2e_request_latency_seconds_count{tier="bronze"} 1.0' in metrics
        assert 'iterserve_e2e_request_latency_seconds_count{tier="gold"} 1.0' in metrics
        body["priority"] = "premium"
        r = await http.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400 and "gold" in r.json()["error"]["message"]

    run_with_server(tokenizer, check, CONFIG)


def test_absurdly_nested_body_is_400(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = b"[" * 100_000 + b"]" * 100_000
        r = await http.put(URL, content=body, headers=ADMIN)
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]

    run_with_server(tokenizer, check, CONFIG)
