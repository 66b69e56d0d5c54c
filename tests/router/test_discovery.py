"""Replica discovery: EndpointSlice parsing, and list + watch against KMock.

KMock's ``KubernetesEmulator`` is a real HTTP server keeping objects in memory: the
tests create, patch and delete EndpointSlices through it, and the discovery's
official (blocking) ``kubernetes`` client lists and watches them over the socket.
Watch endings and 410 Gone are scripted with KMock reactions on the first watches.
"""

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import kmock
import pytest
import yaml
from kubernetes import client, watch

from iterserve.router.discovery import (
    Endpoint,
    EndpointSliceDiscovery,
    StaticDiscovery,
    slice_endpoints,
    usable_endpoints,
)

NAMESPACE = "serving"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
HTTP_AND_METRICS = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]


def endpoint(address: str, pod: str, **conditions: bool) -> dict[str, Any]:
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE},
    }


def endpoint_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    service: str = "llm",
    ports: list[dict[str, Any]] | None = None,
    resource_version: str | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "labels": {"kubernetes.io/service-name": service},
    }
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata,
        "addressType": address_type,
        "ports": HTTP_AND_METRICS if ports is None else ports,
        "endpoints": endpoints,
    }


def urls(endpoints: list[Endpoint]) -> list[str]:
    return [e.url for e in endpoints]


# Parsing (pure functions of the slices' JSON).


def test_slice_endpoints_port_address_and_conditions() -> None:
    eps = [
        endpoint("10.0.0.1", "llm-0"),  # nil ready counts as ready
        endpoint("10.0.0.2", "llm-1", ready=True),
        endpoint("10.0.0.3", "llm-2", ready=False),
        endpoint("10.0.0.4", "llm-3", ready=True, terminating=True),
        {"addresses": ["10.0.0.5"]},  # no conditions, no targetRef
        {"addresses": [], "conditions": {"ready": True}},  # no address: skipped
    ]
    assert slice_endpoints(endpoint_slice("a", eps), "http") == [
        Endpoint("http://10.0.0.1:8000", "llm-0", ready=True),
        Endpoint("http://10.0.0.2:8000", "llm-1", ready=True),
        Endpoint("http://10.0.0.3:8000", "llm-2", ready=False),
        Endpoint("http://10.0.0.4:8000", "llm-3", ready=False),
        Endpoint("http://10.0.0.5:8000", "10.0.0.5:8000", ready=True),
    ]
    # The port named port_name, else the only port; several and none named: nothing.
    assert urls(slice_endpoints(endpoint_slice("a", eps[:1]), "metrics")) == [
        "http://10.0.0.1:9090"
    ]
    only_port = endpoint_slice("a", eps[:1], ports=[{"name": "", "port": 8080}])
    assert urls(slice_endpoints(only_port, "http")) == ["http://10.0.0.1:8080"]
    assert urls(slice_endpoints(only_port, None)) == ["http://10.0.0.1:8080"]
    assert slice_endpoints(endpoint_slice("a", eps[:1]), "grpc") == []
    assert slice_endpoints(endpoint_slice("a", eps[:1], ports=[]), "http") == []
    # A slice whose endpoints are null (as the API sends an empty slice).
    assert slice_endpoints({**endpoint_slice("a", []), "endpoints": None}, "http") == []
    v6 = endpoint_slice("a", [endpoint("fd00::5", "llm-0")], address_type="IPv6")
    assert urls(slice_endpoints(v6, "http")) == ["http://[fd00::5]:8000"]


def test_usable_endpoints_union_sorted_deduplicated_and_labelled() -> None:
    slices = [
        endpoint_slice("b", [endpoint("10.0.0.9", "llm-9"), endpoint("10.0.0.1", "llm-1")]),
        endpoint_slice(
            "a", [endpoint("10.0.0.1", "llm-1"), endpoint("10.0.0.2", "x", ready=False)]
        ),
        endpoint_slice("other", [endpoint("10.0.0.7", "other-0")], service="other"),
    ]
    assert usable_endpoints(slices, "llm", "http") == [
        Endpoint("http://10.0.0.1:8000", "llm-1", ready=True),
        Endpoint("http://10.0.0.9:8000", "llm-9", ready=True),
    ]


# Static list.


def test_static_discovery_reports_the_list_once_and_returns() -> None:
    discovery = StaticDiscovery(["http://10.0.0.1:8000/", "http://r2:9000", "http://r2:9000"])
    calls: list[list[Endpoint]] = []
    asyncio.run(asyncio.wait_for(discovery.run(calls.append), 1))
    expected = [
        Endpoint("http://10.0.0.1:8000", "10.0.0.1:8000", ready=True),
        Endpoint("http://r2:9000", "r2:9000", ready=True),
    ]
    assert calls == [expected]
    assert discovery.current() == expected


@pytest.mark.parametrize("bad", [[], ["10.0.0.1:8000"], ["ftp://host:21"], ["http://"]])
def test_static_discovery_rejects_bad_urls(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        StaticDiscovery(bad)


# List + watch against KMock.


@contextlib.asynccontextmanager
async def mock_cluster() -> AsyncIterator[tuple[kmock.KubernetesEmulator, client.ApiClient]]:
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
        configuration = client.Configuration(host=str(server.url).rstrip("/"))
        with client.ApiClient(configuration) as api_client:
            yield k8s, api_client


class Changes:
    """Records on_change calls; ``next()`` waits for the following one."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[Endpoint]] = asyncio.Queue()

    def __call__(self, endpoints: list[Endpoint]) -> None:
        self.queue.put_nowait(endpoints)

    async def next(self) -> list[str]:
        return urls(await asyncio.wait_for(self.queue.get(), timeout=5))


@contextlib.asynccontextmanager
async def running(discovery: EndpointSliceDiscovery, changes: Changes) -> AsyncIterator[None]:
    task = asyncio.create_task(discovery.run(changes))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=15))


def test_watch_follows_readiness_termination_and_slices() -> None:
    async def scenario() -> None:
        async with mock_cluster() as (k8s, api_client):
            ready_pair = [endpoint("10.0.0.1", "llm-0"), endpoint("10.0.0.2", "llm-1", ready=True)]
            await k8s.post(PATH, json=endpoint_slice("llm-a", ready_pair))
            decoy = endpoint_slice("other-a", [endpoint("10.9.0.1", "o-0")], service="other")
            await k8s.post(PATH, json=decoy)
            discovery = EndpointSliceDiscovery("llm", NAMESPACE, api_client=api_client)
            changes = Changes()
            async with running(discovery, changes):
                assert await changes.next() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
                assert [e.name for e in discovery.current()] == ["llm-0", "llm-1"]
                listing = k8s[kmock.action.LIST][0]
                assert listing.url.path == PATH
                assert listing.params["labelSelector"] == "kubernetes.io/service-name=llm"

                unready = [ready_pair[0], endpoint("10.0.0.2", "llm-1", ready=False)]
                await k8s.patch(f"{PATH}/llm-a", json={"endpoints": unready})
                assert await changes.next() == ["http://10.0.0.1:8000"]

                # Another Service's slice changing calls nobody: the next call is llm-a's.
                await k8s.patch(f"{PATH}/other-a", json={"endpoints": []})
                terminating = [
                    endpoint("10.0.0.1", "llm-0", ready=True, terminating=True),
                    endpoint("10.0.0.2", "llm-1", ready=True),
                ]
                await k8s.patch(f"{PATH}/llm-a", json={"endpoints": terminating})
                assert await changes.next() == ["http://10.0.0.2:8000"]

                await k8s.post(PATH, json=endpoint_slice("llm-b", [endpoint("10.0.1.1", "llm-2")]))
                assert await changes.next() == ["http://10.0.0.2:8000", "http://10.0.1.1:8000"]

                await k8s.delete(f"{PATH}/llm-a")
                assert await changes.next() == ["http://10.0.1.1:8000"]
                assert urls(discovery.current()) == ["http://10.0.1.1:8000"]
                assert len(k8s[kmock.action.LIST]) == 1  # all of it through one watch
                assert changes.queue.empty()

    run(scenario)


def test_watch_end_resumes_and_410_relists() -> None:
    gone = {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": 410,
            "reason": "Expired",
            "message": "too old resource version: 7 (12)",
        },
    }

    async def scenario() -> None:
        async with mock_cluster() as (k8s, api_client):
            await k8s.post(PATH, json=endpoint_slice("llm-a", [endpoint("10.0.0.1", "llm-0")]))
            two = [endpoint("10.0.0.1", "llm-0"), endpoint("10.0.0.2", "llm-1")]
            modified = {
                "type": "MODIFIED",
                "object": endpoint_slice("llm-a", two, resource_version="7"),
            }
            # The first watch delivers one event and ends (as at timeoutSeconds); the second
            # is told its resource version expired; later ones are the emulator's live watch.
            # Neither waits for a retry (the scenario's 15 s timeout would fail first).
            k8s[kmock.action.WATCH][:1] << (modified,)
            k8s[kmock.action.WATCH][1:2] << (gone,)
            discovery = EndpointSliceDiscovery(
                "llm", NAMESPACE, api_client=api_client, retry_initial_s=60
            )
            changes = Changes()
            async with running(discovery, changes):
                assert await changes.next() == ["http://10.0.0.1:8000"]  # the list
                assert await changes.next() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
                # The 410 re-lists: the emulator's state (one endpoint) replaces the watch's.
                assert await changes.next() == ["http://10.0.0.1:8000"]
                await k8s.post(PATH, json=endpoint_slice("llm-b", [endpoint("10.0.1.1", "llm-2")]))
                assert await changes.next() == ["http://10.0.0.1:8000", "http://10.0.1.1:8000"]
                watches = k8s[kmock.action.WATCH]
                assert watches[1].params["resourceVersion"] == "7"  # resumed, not re-listed
                assert len(watches) == 3
                assert len(k8s[kmock.action.LIST]) == 2

    run(scenario)


def test_errors_back_off_and_relist() -> None:
    async def scenario() -> None:
        async with mock_cluster() as (k8s, api_client):
            await k8s.post(PATH, json=endpoint_slice("llm-a", [endpoint("10.0.0.1", "llm-0")]))
            k8s[kmock.action.LIST][:1] << 500
            k8s[kmock.action.WATCH][:1] << 410 << {"kind": "Status", "code": 410}
            discovery = EndpointSliceDiscovery(
                "llm", NAMESPACE, api_client=api_client, retry_initial_s=0.01
            )
            changes = Changes()
            async with running(discovery, changes):
                # The first list failed (500) and was retried.
                assert await changes.next() == ["http://10.0.0.1:8000"]
                await k8s.post(PATH, json=endpoint_slice("llm-b", [endpoint("10.0.1.1", "llm-2")]))
                assert await changes.next() == ["http://10.0.0.1:8000", "http://10.0.1.1:8000"]
                # The watch's HTTP 410 forced the third list, which came before this change.
                assert len(k8s[kmock.action.LIST]) == 3

    run(scenario)


def test_a_watch_opened_just_after_the_stop_is_stopped_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The follower thread checked ``stop`` before it was set and opens its watch after the
    task's ``finally`` ran (the race a loaded CI machine hit: the mock API server then waited
    on that watch at shutdown): the watch must still be stopped, not run for its 300 s."""
    cancelled = threading.Event()

    class LateWatch(watch.Watch):  # created only once the task is cancelled
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            cancelled.wait(5)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(watch, "Watch", LateWatch)

    async def scenario() -> None:
        async with mock_cluster() as (k8s, api_client):
            await k8s.post(PATH, json=endpoint_slice("llm-a", [endpoint("10.0.0.1", "llm-0")]))
            discovery = EndpointSliceDiscovery("llm", NAMESPACE, api_client=api_client)
            changes = Changes()
            async with running(discovery, changes):
                assert await changes.next() == ["http://10.0.0.1:8000"]
                (follower,) = (t for t in threading.enumerate() if t.name.startswith("endpoint"))
            cancelled.set()
            for _ in range(100):  # the API server is still up: only a stop ends the watch
                if not follower.is_alive():
                    break
                await asyncio.sleep(0.05)
            assert not follower.is_alive(), "the watch opened after the stop still runs"

    run(scenario)


def test_kubeconfig_is_loaded_and_an_empty_service_reported(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
            await k8s.post(
                PATH, json=endpoint_slice("other-a", [endpoint("10.9.0.1", "o-0")], service="other")
            )
            kubeconfig = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "mock", "cluster": {"server": str(server.url)}}],
                "users": [{"name": "router", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "mock", "user": "router"}}],
                "current-context": "ctx",
            }
            path = tmp_path / "kubeconfig"
            path.write_text(yaml.safe_dump(kubeconfig))
            # Read at import from $KUBECONFIG; not in a pod, so load_incluster_config fails.
            monkeypatch.setattr(
                "kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path)
            )
            monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
            changes = Changes()
            async with running(EndpointSliceDiscovery("llm", NAMESPACE), changes):
                assert await changes.next() == []  # synced, nothing ready yet
            assert k8s[kmock.action.LIST][0].headers["Authorization"] == "Bearer s3cret"

    run(scenario)
