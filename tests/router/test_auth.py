"""API keys at the router (``--api-keys-file``, ``--router-token-file``) over a fake upstream:
the tenant set from the key, client tenant and tier headers stripped, a tier the key may not
use refused before any replica is tried, and both files re-read after a Kubernetes-style
Secret swap (a bad rewrite keeps the last good version)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from credential_data import KEYS, TOKEN
from router_utils import pool_of, router, until
from server_utils import run_server
from sim_profiles import make_profile, write_profile

from iterserve.credentials import CredentialsError
from iterserve.router.config import RouterConfig
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import ReplicaPool
from iterserve.router.proxy import Proxy
from iterserve.router.scoring import Picker

A = "http://a:1"


class SecretVolume:
    """A directory laid out as kubelet mounts a Secret: ``NAME -> ..data/NAME``, ``..data ->
    ..<version>``; :meth:`write` swaps ``..data`` to a new version atomically."""

    def __init__(self, root: Path, files: dict[str, str]) -> None:
        self.root = root
        self.version = 0
        root.mkdir()
        self.write(files)
        for name in files:
            (root / name).symlink_to(f"..data/{name}")

    def write(self, files: dict[str, str]) -> None:
        self.version += 1
        target = self.root / f"..v{self.version}"
        target.mkdir()
        for name, text in files.items():
            (target / name).write_text(text)
        (self.root / "..tmp").symlink_to(target.name)
        os.replace(self.root / "..tmp", self.root / "..data")

    def path(self, name: str) -> str:
        return str(self.root / name)


class FakeHTTP:
    """The upstream session: records what was sent, answers 200 ``{}``."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def request(self, method: str, url: Any, **kwargs: Any) -> Any:
        self.sent.append(kwargs["headers"])
        return _Answer()


class _Answer:
    status = 200
    headers = {"content-type": "application/json"}  # noqa: RUF012

    def __init__(self) -> None:
        self.content = self

    async def read(self) -> bytes:
        return b"{}"

    async def iter_any(self) -> Any:
        yield b"{}"

    def close(self) -> None:
        pass


def _proxy(tmp_path: Path) -> tuple[Proxy, FakeHTTP, SecretVolume]:
    volume = SecretVolume(tmp_path / "auth", {"keys.yaml": KEYS, "token": TOKEN})
    config = RouterConfig(
        backend=(A,),
        api_keys_file=volume.path("keys.yaml"),
        router_token_file=volume.path("token"),
    )
    pool = ReplicaPool()
    pool.set_urls([A])
    pool.backends[A].state.ready = True
    proxy = Proxy(pool, Picker("round_robin"), config, RouterMetrics())
    http = FakeHTTP()
    proxy.http = http  # type: ignore[assignment]
    return proxy, http, volume


def _call(proxy: Proxy, key: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    """One POST /v1/completions through the proxy: (status, JSON body)."""
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode()), *raw],
    }
    messages = [{"type": "http.request", "body": json.dumps(body).encode()}]
    sent: list[Any] = []

    async def receive() -> Any:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(proxy(scope, receive, send))
    answer = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(answer)


def test_the_tenant_is_the_keys_and_client_sent_tenant_and_tier_headers_are_stripped(
    tmp_path: Path,
) -> None:
    proxy, http, _ = _proxy(tmp_path)
    forged = {
        "x_tenant_id": "bob",
        "x_iterserve_tiers": '["premium"]',
        "x_iterserve_default_tier": '"premium"',
    }
    assert _call(proxy, "sk-acme-0001", {"prompt": "hi"}, **forged)[0] == 200
    assert _call(proxy, "sk-bob-00001", {"prompt": "hi", "priority": "premium"}, **forged)[0] == 200
    acme, bob = http.sent
    assert acme["x-tenant-id"] == "acme"
    assert json.loads(acme["x-iterserve-tiers"]) == ["best-effort", "standard"]
    assert json.loads(acme["x-iterserve-default-tier"]) == "standard"
    assert acme["authorization"] == f"Bearer {TOKEN}"  # the router's token, not the client's
    # A key with any tier: no tier headers at all (the forged ones are gone too).
    assert bob["x-tenant-id"] == "bob" and bob["authorization"] == f"Bearer {TOKEN}"
    assert "x-iterserve-tiers" not in bob and "x-iterserve-default-tier" not in bob
    status, answer = _call(proxy, "sk-not-a-key", {"prompt": "hi"})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert len(http.sent) == 2


def test_a_tier_name_the_key_may_not_use_is_403_and_no_replica_is_tried(tmp_path: Path) -> None:
    proxy, http, _ = _proxy(tmp_path)
    status, answer = _call(proxy, "sk-acme-0001", {"prompt": "hi", "priority": "premium"})
    assert status == 403
    assert answer["error"] == {
        "message": "this API key may not use tier 'premium' (its tiers: ['best-effort', "
        "'standard'])",
        "type": "permission_error",
        "param": "priority",
        "code": "tier_not_allowed",
    }
    assert http.sent == [] and proxy.pool.backends[A].in_flight == 0
    # A tier it may use, and an integer (the server maps it to a tier and checks), go on.
    for priority in ("best-effort", 0):
        assert _call(proxy, "sk-acme-0001", {"prompt": "hi", "priority": priority})[0] == 200
    assert len(http.sent) == 2


def test_the_files_are_re_read_after_a_secret_swap_and_a_bad_rewrite_keeps_the_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proxy, http, volume = _proxy(tmp_path)
    assert proxy.auth.keys is not None and proxy.auth.token is not None
    proxy.auth.keys.check_interval_s = proxy.auth.token.check_interval_s = 0.0
    assert _call(proxy, "sk-acme-0001", {"prompt": "hi"})[0] == 200
    volume.write({"keys.yaml": "- {key: sk-carol-001, tenant: carol}", "token": "router-token-2"})
    assert _call(proxy, "sk-acme-0001", {"prompt": "hi"})[0] == 401  # revoked
    assert _call(proxy, "sk-carol-001", {"prompt": "hi"})[0] == 200
    assert http.sent[-1]["x-tenant-id"] == "carol"
    assert http.sent[-1]["authorization"] == "Bearer router-token-2"
    # A rotation's second step: the new token first, the old one still accepted by replicas.
    volume.write(
        {"keys.yaml": "- {key: sk-carol-001, tenant: carol}", "token": "t-3\nrouter-token-2"}
    )
    assert _call(proxy, "sk-carol-001", {"prompt": "hi"})[0] == 200
    assert http.sent[-1]["authorization"] == "Bearer t-3"
    volume.write({"keys.yaml": "- {key: sk-carol-001, tenant: carol}", "token": "router-token-2"})
    assert _call(proxy, "sk-carol-001", {"prompt": "hi"})[0] == 200
    with caplog.at_level(logging.ERROR, "iterserve.credentials"):
        volume.write({"keys.yaml": "- {key: sk-dave-0001}", "token": " "})
        assert _call(proxy, "sk-carol-001", {"prompt": "hi"})[0] == 200
    assert http.sent[-1]["authorization"] == "Bearer router-token-2"
    assert "entry 0: tenant: Field required" in caplog.text
    assert "keeping the last good version" in caplog.text


def test_a_keys_file_rewritten_too_deeply_nested_is_logged_not_a_500(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the breaker: a rewrite nested past the recursion limit raised RecursionError
    out of the request's key check (a bare 500 from uvicorn, the request lost)."""
    proxy, http, volume = _proxy(tmp_path)
    assert proxy.auth.keys is not None
    proxy.auth.keys.check_interval_s = 0.0
    with caplog.at_level(logging.ERROR, "iterserve.credentials"):
        volume.write({"keys.yaml": "[" * 50_000, "token": TOKEN})
        assert _call(proxy, "sk-acme-0001", {"prompt": "hi"})[0] == 200
    assert "keeping the last good version" in caplog.text
    assert "nested too deeply" in caplog.text or "maximum nesting depth" in caplog.text
    assert len(http.sent) == 1


def test_a_bad_keys_file_at_start_names_the_file_and_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS + "- {key: sk-acme-0001, tenant: again}\n")
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with pytest.raises(CredentialsError, match=rf"{path}: entry 2: the key of entry 0 again"):
        config = RouterConfig((A,), api_keys_file=str(path), router_token_file=str(token))
        Proxy(ReplicaPool(), Picker("round_robin"), config, RouterMetrics())
    # Found by the breaker: keys without the router token started, and the replicas then
    # trusted none of the key's headers (an integer priority escaped the key's tiers).
    with pytest.raises(ValueError, match="--api-keys-file needs --router-token-file"):
        RouterConfig((A,), api_keys_file=str(path))
    with pytest.raises(ValueError, match="--api-keys-file needs --router-token-file"):
        RouterConfig((A,), api_keys_file=str(path), backend_api_key="backend-key-1")
    with pytest.raises(ValueError, match=r"--api-key \(one key\) or --api-keys-file, not both"):
        RouterConfig((A,), api_key="k", api_keys_file=str(path))
    with pytest.raises(ValueError, match="--backend-api-key or --router-token-file"):
        RouterConfig((A,), backend_api_key="k", router_token_file=str(path))


def test_through_the_real_router_the_replica_counts_the_keys_tenant(tmp_path: Path) -> None:
    """End to end: ``iterserve router`` in front of a simulated replica (``serve --simulate``),
    both given the keys and the router token; the replica's per-tenant metric counts the key's
    tenant, whatever tenant the client claims, through the router or directly."""
    profile = write_profile(tmp_path / "profile.json", make_profile(fixed_s=0.002))
    volume = SecretVolume(tmp_path / "auth", {"keys.yaml": KEYS, "token": TOKEN})
    files = ("--api-keys-file", volume.path("keys.yaml"))
    files += ("--router-token-file", volume.path("token"))
    with run_server("--simulate", str(profile), *files) as replica:

        async def run() -> None:
            async with (
                router("--backend", replica.url, *files) as (url, app),
                httpx.AsyncClient(timeout=30) as http,
            ):
                await until(lambda: len(pool_of(app).ready()) == 1, "ready")
                claims = {"Authorization": "Bearer sk-acme-0001", "X-Tenant-Id": "bob"}
                body = {"prompt": "hi", "max_tokens": 2, "user": "bob"}
                for base in (url, url, replica.url):  # twice routed, once direct
                    r = await http.post(base + "/v1/completions", json=body, headers=claims)
                    assert r.status_code == 200, r.text
                r = await http.post(url + "/v1/completions", json=body)
                assert r.status_code == 401  # no key: refused at the router
                metrics = (await http.get(replica.url + "/metrics")).text
            count = "iterserve_tenant_request_queue_time_seconds_count"
            assert f'{count}{{tenant="acme"}} 3.0' in metrics
            assert 'tenant="bob"' not in metrics

        asyncio.run(run())
