"""``iterserve router --k8s-service``: replicas discovered from EndpointSlices (served by
KMock) receive the traffic, and follow the slices live."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import kmock
import pytest
import yaml
from router_utils import pool_of, router, until
from server_utils import run_server
from sim_profiles import make_profile, write_profile

NAMESPACE = "serving"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def _slice(name: str, port: int, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": "llm"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}],
    }


def test_requests_follow_the_endpoint_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = write_profile(tmp_path / "profile.json", make_profile(fixed_s=0.01))
    with run_server("--simulate", str(profile)) as a, run_server("--simulate", str(profile)) as b:
        port_a, port_b = urlparse(a.url).port, urlparse(b.url).port
        assert port_a and port_b

        async def scenario() -> None:
            async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
                kubeconfig = {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "mock", "cluster": {"server": str(server.url)}}],
                    "users": [{"name": "router", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "mock", "user": "router"}}],
                    "current-context": "c",
                }
                path = tmp_path / "kubeconfig"
                path.write_text(yaml.safe_dump(kubeconfig))
                monkeypatch.setattr(
                    "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path)
                )
                monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
                await k8s.post(PATH, json=_slice("llm-a", port_a))
                flags = ("--k8s-service", "llm", "--namespace", NAMESPACE)
                async with router(*flags) as (url, app), httpx.AsyncClient(timeout=30) as http:
                    pool = pool_of(app)

                    async def routed_to(n: int) -> set[str]:
                        body = {"prompt": "which replica?", "max_tokens": 2}
                        rs = [await http.post(url + "/v1/completions", json=body) for _ in range(n)]
                        assert all(r.status_code == 200 for r in rs)
                        return {r.headers["x-routed-to"] for r in rs}

                    await until(lambda: [x.url for x in pool.ready()] == [a.url], "a only")
                    assert await routed_to(4) == {a.url}
                    await k8s.post(PATH, json=_slice("llm-b", port_b))
                    await until(lambda: len(pool.ready()) == 2, "b discovered")
                    await k8s.patch(f"{PATH}/llm-a", json=_slice("llm-a", port_a, ready=False))
                    await until(lambda: [x.url for x in pool.ready()] == [b.url], "a unready")
                    assert await routed_to(4) == {b.url}

        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
