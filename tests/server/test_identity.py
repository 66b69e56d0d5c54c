"""Tenants and tiers from credentials at the server (``--api-keys-file``,
``--router-token-file``), over a fake engine: the router's tenant and tier headers are
honoured only with the router token, a key of the keys file gets its own tenant and tiers
whatever it sends, and an integer priority mapping to a tier the key may not use is 403."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from credential_data import KEYS, TOKEN
from fake_engine import FakeEngineClient, run_with_server

from iterserve.config import ConfigError, ServerConfig
from iterserve.openai_http import APIError
from iterserve.server.app import build_app
from iterserve.server.identity import ServerAuth

BODY = {"prompt": "Hi", "max_tokens": 1}
PRIORITY = {"premium": 0, "standard": 1, "best-effort": 2}  # the default tiers


def _config(tmp_path: Path) -> ServerConfig:
    (tmp_path / "keys.yaml").write_text(KEYS)
    (tmp_path / "token").write_text(TOKEN + "\nrouter-token-old\n")  # mid-rotation
    return ServerConfig(
        api_key="plain-key-1",
        api_keys_file=str(tmp_path / "keys.yaml"),
        router_token_file=str(tmp_path / "token"),
    )


async def _post(
    http: httpx.AsyncClient, key: str, body: dict[str, Any] | None = None, **headers: str
) -> httpx.Response:
    sent = {k.replace("_", "-"): v for k, v in headers.items()}
    return await http.post(
        "/v1/completions",
        json={**BODY, **(body or {})},
        headers={"Authorization": f"Bearer {key}", **sent},
    )


def test_tenant_and_tier_headers_are_honoured_only_with_the_router_token(
    tokenizer: Any, tmp_path: Path
) -> None:
    standard_only = {
        "x_tenant_id": "acme",
        "x_iterserve_tiers": json.dumps(["standard"]),
        "x_iterserve_default_tier": json.dumps("standard"),
    }

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        # The router's requests: its tenant and tiers.
        assert (await _post(http, TOKEN, **standard_only)).status_code == 200
        r = await _post(http, TOKEN, {"priority": "premium"}, **standard_only)
        assert r.status_code == 403 and r.json()["error"]["code"] == "tier_not_allowed"
        r = await _post(http, TOKEN, {"priority": 0, "user": "u"}, x_tenant_id="free")
        assert r.status_code == 200  # no tier headers: any tier
        assert (await _post(http, TOKEN, {"user": "via-user"})).status_code == 200
        # Anyone else sending the same headers: not trusted.
        assert (await _post(http, "sk-bob-00001", **standard_only)).status_code == 200
        r = await _post(http, "plain-key-1", {"priority": "premium", "user": "u"}, **standard_only)
        assert r.status_code == 200  # --api-key: the default tenant, any tier
        assert (await _post(http, "nope-nope", **standard_only)).status_code == 401
        r = await _post(http, TOKEN, x_iterserve_tiers="premium")  # not the router's JSON
        assert r.status_code == 400
        # The file's other token (a rotation's): trusted as well.
        r = await _post(http, "router-token-old", {"priority": "premium"}, **standard_only)
        assert r.status_code == 403
        seen = [(a.tenant, a.priority) for a in fake.added]
        assert seen == [("acme", 1), ("free", 0), ("via-user", 1), ("bob", 1), ("default", 0)]

    run_with_server(tokenizer, check, server_config=_config(tmp_path))


def test_a_direct_key_gets_its_tenant_and_tiers_and_integer_priorities_are_checked(
    tokenizer: Any, tmp_path: Path
) -> None:
    forged = {"x_tenant_id": "bob", "x_iterserve_tiers": json.dumps(["premium"])}

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        for priority, status in [
            (None, 200),  # the key's default tier
            (2, 200),  # best-effort
            ("best-effort", 200),
            (0, 403),  # premium
            (-7, 403),  # above every tier: premium
            ("premium", 403),
        ]:
            body = {} if priority is None else {"priority": priority}
            r = await _post(http, "sk-acme-0001", {**body, "user": "bob"}, **forged)
            assert r.status_code == status, (priority, r.text)
            if status == 403:
                assert r.json()["error"] == {
                    "message": "this API key may not use tier 'premium' (its tiers: "
                    "['best-effort', 'standard'])",
                    "type": "permission_error",
                    "param": "priority",
                    "code": "tier_not_allowed",
                }
        seen = [(a.tenant, a.priority) for a in fake.added]
        assert seen == [("acme", PRIORITY["standard"]), ("acme", 2), ("acme", 2)]
        schema = (await http.get("/openapi.json")).json()
        assert "403" in schema["paths"]["/v1/completions"]["post"]["responses"]
        metrics = (await http.get("/metrics")).text
        assert 'iterserve_tenant_request_queue_time_seconds_count{tenant="acme"} 3.0' in metrics
        assert 'tenant="bob"' not in metrics

    run_with_server(tokenizer, check, server_config=_config(tmp_path))


def test_a_tier_header_nested_past_the_recursion_limit_is_400_not_500(tmp_path: Path) -> None:
    """Found by the breaker: ``X-Iterserve-Tiers: [[[[...`` with the router token raised
    RecursionError out of the Bearer check (a 500, the connection dropped)."""
    auth = ServerAuth(_config(tmp_path))
    for name in (b"x-iterserve-tiers", b"x-iterserve-default-tier"):
        with pytest.raises(APIError) as e:
            auth.grant_for(f"Bearer {TOKEN}".encode(), [(name, b"[" * 100_000)])
        assert e.value.status == 400 and "nested too deeply" in str(e.value.body())


def test_a_bad_keys_file_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("- {key: sk-acme-0001, tenant: acme, tiers: [premium]}\n")
    fake = object()
    with pytest.raises(ConfigError, match=rf"{path}: entry 0: default_tier is required"):
        build_app(fake, ServerConfig(api_keys_file=str(path)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="No such file"):
        build_app(fake, ServerConfig(router_token_file=str(tmp_path / "none")))  # type: ignore[arg-type]
