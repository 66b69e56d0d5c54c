"""The router's metrics label a replica by its pod name (``host:port`` for a ``--backend``
URL), and a replica that leaves takes its series with it: a rolling restart of N pods
leaves N series, not 2N. Replicas come from EndpointSlices served by KMock; requests go
through the router's own proxy and relay over a fake upstream (no sockets to replicas)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import kmock
from kubernetes import client

from iterserve.router.app import build_router_app
from iterserve.router.asgi import ProxiedRequest
from iterserve.router.config import RouterConfig
from iterserve.router.discovery import EndpointSliceDiscovery, replicas_by_name
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import ReplicaPool
from iterserve.router.proxy import Proxy
from iterserve.router.scoring import Picker

NAMESPACE = "serving"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def _slice(pods: dict[str, str]) -> dict[str, Any]:
    """The Service's one EndpointSlice with ``pods`` (name -> address), all ready."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "llm-x",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": "llm"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE},
            }
            for pod, address in pods.items()
        ],
    }


class _Answer:
    """A replica's whole JSON answer, as aiohttp's response gives it to the relay."""

    def __init__(self) -> None:
        self.status = 200
        self.headers = {"content-type": "application/json"}

    async def read(self) -> bytes:
        return b"{}"

    def close(self) -> None:
        pass


class _Upstream:
    """The proxy's upstream session: every replica answers 200."""

    async def request(self, method: str, url: Any, **kwargs: Any) -> _Answer:
        return _Answer()

    async def close(self) -> None:
        pass


async def _send(proxy: Proxy) -> None:
    scope = {"method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions"}
    request = ProxiedRequest.from_scope({**scope, "query_string": b"", "headers": []})
    request.body = json.dumps({"prompt": "hi"}).encode()
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await proxy.route(request, send, arrival=0.0)
    assert sent[0]["status"] == 200


def _series(metrics: RouterMetrics) -> dict[str, set[str]]:
    """Metric name -> the ``replica`` labels of its series (the ``none`` one left out)."""
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if replica is not None and replica != "none":
                out.setdefault(sample.name, set()).add(replica)
    return out


def test_a_rolling_restart_leaves_series_for_the_live_pods_only() -> None:
    async def scenario() -> None:
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
            old = {f"llm-old-{i}": f"10.0.0.{i + 1}" for i in range(3)}
            await k8s.post(PATH, json=_slice(old))
            pool = ReplicaPool()
            app = build_router_app(pool, Picker("round_robin"), RouterConfig(k8s_service="llm"))
            proxy, metrics = app.proxy, app.proxy.metrics
            proxy.http = _Upstream()  # type: ignore[assignment]
            configuration = client.Configuration(host=str(server.url).rstrip("/"))
            api_client = client.ApiClient(configuration)
            discovery = EndpointSliceDiscovery("llm", NAMESPACE, api_client=api_client)

            def on_change(endpoints: Any) -> None:  # what the router's discovery task does
                pool.set_replicas(replicas_by_name(endpoints))
                for b in pool.backends.values():
                    b.state.ready = True  # as if polled

            async def pods_are(names: set[str]) -> None:
                async with asyncio.timeout(5):
                    while {b.name for b in pool.backends.values()} != names:
                        await asyncio.sleep(0.01)

            task = asyncio.create_task(discovery.run(on_change))
            try:
                await pods_are(set(old))
                for _ in range(6):
                    await _send(proxy)
                pool.record_failure(pool.named("llm-old-2"), "test", request=True)
                for _ in range(2):  # ejected: an ejections series too
                    pool.record_failure(pool.named("llm-old-2"), "test", request=True)
                assert _series(metrics) == {
                    "iterserve_router_requests_total": set(old),
                    "iterserve_router_ejections_total": {"llm-old-2"},
                }
                # One pod at a time replaced by a new one (new name, new address); the first
                # leaves with a request still open: its series stay until that one ends.
                pods = dict(old)
                open_attempt = pool.begin_attempt(pool.named("llm-old-0"))
                for i in range(3):
                    del pods[f"llm-old-{i}"]
                    pods[f"llm-new-{i}"] = f"10.0.1.{i + 1}"
                    await k8s.patch(f"{PATH}/llm-x", json=_slice(pods))
                    await pods_are(set(pods))
                    for _ in range(len(pods)):  # round robin: one each
                        await _send(proxy)
                    if i == 0:
                        assert "llm-old-0" in _series(metrics)["iterserve_router_requests_total"]
                        pool.end_attempt(open_attempt)
                    live = _series(metrics)["iterserve_router_requests_total"]
                    assert live <= set(pods), live  # never more series than live pods
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                api_client.close()
            assert _series(metrics) == {"iterserve_router_requests_total": set(pods)}
            assert set(pods) == {"llm-new-0", "llm-new-1", "llm-new-2"}

    asyncio.run(asyncio.wait_for(scenario(), timeout=20))


def test_a_backend_url_is_labelled_by_its_host_and_port() -> None:
    pool = ReplicaPool()
    pool.set_urls(["http://10.0.0.5:8000/", "http://replica-b:9000"])
    assert sorted(b.name for b in pool.backends.values()) == ["10.0.0.5:8000", "replica-b:9000"]
    assert pool.named("10.0.0.5:8000").url == "http://10.0.0.5:8000"
    removed: list[str] = []
    pool.on_remove = removed.append
    pool.set_urls(["http://replica-b:9000"])
    assert removed == ["10.0.0.5:8000"]
