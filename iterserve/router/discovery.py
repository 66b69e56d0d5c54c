"""Replica discovery: a fixed list of URLs, or a Kubernetes Service's EndpointSlices.

Both discoveries have one interface: ``await discovery.run(on_change)`` calls
``on_change(endpoints)`` on the event loop's thread with the full set of usable
replicas each time that set changes, and ``discovery.current()`` returns the last set.

``EndpointSliceDiscovery`` reads ``discovery.k8s.io/v1`` EndpointSlices through the
official ``kubernetes`` client. Its ServiceAccount needs, in the Service's namespace::

    - apiGroups: ["discovery.k8s.io"]
      resources: ["endpointslices"]
      verbs: ["get", "list", "watch"]
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config, watch

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"

OnChange = Callable[[list["Endpoint"]], None]


@dataclass(frozen=True)
class Endpoint:
    """One replica: ``url`` like ``"http://10.0.0.5:8000"`` (no trailing slash), ``name``
    the pod name (or ``host:port`` when there is none) for logs and metrics labels, and
    ``ready``: whether it may receive traffic. Discoveries report only ready endpoints."""

    url: str
    name: str
    ready: bool


class StaticDiscovery:
    """The replicas given by ``--backend URL``: reported once, never changing.

    Raises ``ValueError`` for an empty list or a URL that is not ``http(s)://host[:port]``.
    Duplicates are dropped; the given order is kept.
    """

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("StaticDiscovery needs at least one backend URL")
        endpoints: dict[str, Endpoint] = {}
        for raw_url in urls:
            url = raw_url.rstrip("/")
            parsed = urllib.parse.urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"backend URL must look like http://host:port, got {raw_url!r}")
            endpoints.setdefault(url, Endpoint(url=url, name=parsed.netloc, ready=True))
        self._endpoints = list(endpoints.values())

    def current(self) -> list[Endpoint]:
        return list(self._endpoints)

    async def run(self, on_change: OnChange) -> None:
        """Call ``on_change`` once with the fixed set, then return."""
        on_change(self.current())


def _usable(conditions: Mapping[str, Any]) -> bool:
    # The API documents a nil `ready` as "ready" (consumers must treat unknown as ready).
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def _select_port(ports: Iterable[Mapping[str, Any]], port_name: str | None) -> int | None:
    ports = [port for port in ports if port.get("port") is not None]
    for port in ports:
        if port_name is not None and port.get("name") == port_name:
            return int(port["port"])
    return int(ports[0]["port"]) if len(ports) == 1 else None


def slice_endpoints(endpoint_slice: Mapping[str, Any], port_name: str | None) -> list[Endpoint]:
    """Every endpoint of one EndpointSlice (its JSON form), usable or not.

    The port is the one named ``port_name`` in ``ports``, or the only port when the
    slice has exactly one; a slice with neither yields nothing. An endpoint's address
    is the first of ``addresses`` (the API says they are fungible), bracketed for
    ``addressType: IPv6``. ``ready`` is ``conditions.ready`` (nil counts as true) and
    not ``conditions.terminating``.
    """
    port = _select_port(endpoint_slice.get("ports") or [], port_name)
    if port is None:
        return []
    bracket = endpoint_slice.get("addressType") == "IPv6"
    endpoints = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        host = f"[{addresses[0]}]" if bracket else addresses[0]
        target_name = (endpoint.get("targetRef") or {}).get("name")
        endpoints.append(
            Endpoint(
                url=f"http://{host}:{port}",
                name=target_name or f"{host}:{port}",
                ready=_usable(endpoint.get("conditions") or {}),
            )
        )
    return endpoints


def usable_endpoints(
    slices: Iterable[Mapping[str, Any]], service: str, port_name: str | None
) -> list[Endpoint]:
    """The union of the ready endpoints of ``service``'s slices, one per URL, sorted by URL.

    Slices not labelled ``kubernetes.io/service-name=<service>`` are ignored (the label
    selector already excludes them on a real API server).
    """
    union: dict[str, Endpoint] = {}
    for endpoint_slice in slices:
        labels = (endpoint_slice.get("metadata") or {}).get("labels") or {}
        if labels.get(SERVICE_NAME_LABEL) != service:
            continue
        for endpoint in slice_endpoints(endpoint_slice, port_name):
            if endpoint.ready:
                union.setdefault(endpoint.url, endpoint)
    return [union[url] for url in sorted(union)]


def replicas_by_name(endpoints: Iterable[Endpoint]) -> dict[str, str]:
    """``name -> url`` of ``endpoints``, what ``ReplicaPool.set_replicas`` takes. A pod
    listed at two addresses (a dual-stack Service's IPv4 and IPv6 slices) is one replica,
    at the first of its URLs."""
    replicas: dict[str, str] = {}
    for endpoint in endpoints:
        replicas.setdefault(endpoint.name, endpoint.url)
    return replicas


def load_api_client() -> client.ApiClient:
    """An API client from the in-cluster ServiceAccount when running in a pod, else from
    the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``). Raises
    ``kubernetes.config.ConfigException`` when neither is found."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


@dataclass(frozen=True)
class _WatchEnd:
    resource_version: str | None  # the last one seen, to resume from
    num_events: int
    expired: bool  # 410 Gone: the resource version is too old, re-list


class EndpointSliceDiscovery:
    """The ready endpoints of a Kubernetes Service, followed live.

    Lists, then watches, the ``discovery.k8s.io/v1`` EndpointSlices labelled
    ``kubernetes.io/service-name=<service>`` in ``namespace`` and keeps the union of
    their endpoints, tracked by slice name (a Service may have several slices; a
    DELETED slice takes its endpoints away). An endpoint is usable when
    ``conditions.ready`` is true or nil and ``conditions.terminating`` is not true; its
    URL is ``http://<first address>:<port>`` with the port named ``port_name`` (or the
    slice's only port). See ``slice_endpoints``.

    The blocking client runs in a daemon thread; ``on_change`` runs on the event loop.
    A watch that ends (the server's ``timeoutSeconds``) resumes from the last
    resourceVersion; a 410 Gone (expired resourceVersion) re-lists; any other error
    (connection refused, 5xx, 403 from missing RBAC) is logged and re-lists after an
    exponential backoff from ``retry_initial_s`` to ``retry_max_s`` seconds. It never
    gives up. ``api_client`` is used as given (tests point it at a mock server);
    without one, ``load_api_client()`` picks in-cluster config or the kubeconfig.
    """

    def __init__(
        self,
        service: str,
        namespace: str,
        port_name: str | None = "http",
        api_client: client.ApiClient | None = None,
        *,
        watch_timeout_s: int = 300,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
    ) -> None:
        self.service = service
        self.namespace = namespace
        self.port_name = port_name
        self._api_client = api_client
        self._watch_timeout_s = watch_timeout_s
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._current: list[Endpoint] = []
        self._active_watch: watch.Watch | None = None

    def current(self) -> list[Endpoint]:
        return list(self._current)

    async def run(self, on_change: OnChange) -> None:
        """Follow the Service until cancelled, calling ``on_change`` after the first
        successful list (even when empty: the set is known) and on every change after.

        Raises ``kubernetes.config.ConfigException`` at start when no ``api_client`` was
        given and no cluster config is found; API errors are retried, never raised.
        One ``run`` at a time per instance.
        """
        loop = asyncio.get_running_loop()
        owned = self._api_client is None
        api_client = self._api_client or await asyncio.to_thread(load_api_client)
        snapshots: asyncio.Queue[list[Endpoint]] = asyncio.Queue()
        stop = threading.Event()

        def emit(endpoints: list[Endpoint]) -> None:  # called from the thread
            try:
                loop.call_soon_threadsafe(snapshots.put_nowait, endpoints)
            except RuntimeError:  # the loop is closed: nobody listens any more
                stop.set()

        thread = threading.Thread(
            target=self._follow,
            args=(api_client, emit, stop, owned),
            name=f"endpointslices-{self.namespace}/{self.service}",
            daemon=True,
        )
        thread.start()
        synced = False
        try:
            while True:
                endpoints = await snapshots.get()
                while not snapshots.empty():  # coalesce a burst of events into one call
                    endpoints = snapshots.get_nowait()
                if not synced or endpoints != self._current:
                    synced = True
                    self._current = endpoints
                    on_change(list(endpoints))
        finally:
            stop.set()
            threading.Thread(
                target=self._stop_watching, args=(thread,), name=f"{thread.name}-stop", daemon=True
            ).start()

    def _stop_watching(self, follower: threading.Thread) -> None:
        """Stop the follower's watch until the follower has ended. Once is not enough: a
        watch the follower opens just after a stop (it checked ``stop`` before it was set)
        would run until its timeout, and ``Watch.stream`` clears a stop that comes before
        its request."""
        while follower.is_alive():
            active = self._active_watch
            if active is not None:
                active.stop()  # kubernetes 37 shuts the socket; older ones stop at the next event
            follower.join(0.05)

    # Everything below runs in the thread.

    def _follow(
        self,
        api_client: client.ApiClient,
        emit: OnChange,
        stop: threading.Event,
        owned: bool,
    ) -> None:
        api = client.DiscoveryV1Api(api_client)
        slices: dict[str, dict[str, Any]] = {}
        resource_version: str | None = None
        listed = False
        delay = self._retry_initial_s
        try:
            while not stop.is_set():
                try:
                    just_listed = not listed
                    if not listed:
                        resource_version = self._list(api, slices)
                        listed = True
                        emit(usable_endpoints(slices.values(), self.service, self.port_name))
                    end = self._watch(api, slices, resource_version, emit)
                except Exception as exc:
                    if stop.is_set():
                        return
                    logger.warning(
                        "EndpointSlices of %s/%s: %s; re-listing in %.1f s%s",
                        self.namespace,
                        self.service,
                        _describe(exc),
                        delay,
                        _rbac_hint(exc),
                    )
                    listed = False
                    stop.wait(delay)
                    delay = min(2 * delay, self._retry_max_s)
                    continue
                resource_version = end.resource_version
                if end.expired:
                    logger.info("EndpointSlice watch expired (410 Gone): re-listing")
                    listed = False
                if end.num_events:
                    delay = self._retry_initial_s
                elif just_listed or not end.expired:
                    # Nothing delivered, and not the usual expiry of a resumed watch: a watch
                    # that fails or ends at once must not become a busy loop.
                    stop.wait(delay)
                    delay = min(2 * delay, self._retry_max_s)
        finally:
            if owned:
                api_client.close()

    def _list(self, api: client.DiscoveryV1Api, slices: dict[str, dict[str, Any]]) -> str | None:
        # With _preload_content=False this is the raw urllib3 response, not the typed model.
        response: Any = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            _preload_content=False,  # raw JSON: the models reject a slice with null endpoints
            _request_timeout=(10, 30),
        )
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        slices.clear()
        for item in body.get("items") or []:
            slices[item["metadata"]["name"]] = item
        version = (body.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    def _watch(
        self,
        api: client.DiscoveryV1Api,
        slices: dict[str, dict[str, Any]],
        resource_version: str | None,
        emit: OnChange,
    ) -> _WatchEnd:
        # return_type "object" keeps the events' objects as plain dicts (see _list).
        active = watch.Watch(return_type="object")
        self._active_watch = active
        num_events = 0
        kwargs: dict[str, Any] = {}
        if resource_version is not None:
            kwargs["resource_version"] = resource_version
        try:
            # Passing timeout_seconds also turns off the client's own retry after a 410,
            # which then reaches us as an ApiException.
            for event in active.stream(
                api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _request_timeout=(10, self._watch_timeout_s + 30),
                **kwargs,
            ):
                num_events += 1
                obj = event["raw_object"]
                metadata = obj.get("metadata") or {}
                resource_version = metadata.get("resourceVersion") or resource_version
                if event["type"] in ("ADDED", "MODIFIED"):
                    slices[metadata["name"]] = obj
                elif event["type"] == "DELETED":
                    slices.pop(metadata["name"], None)
                else:  # BOOKMARK: only the resource version moves
                    continue
                emit(usable_endpoints(slices.values(), self.service, self.port_name))
        except client.ApiException as exc:
            if exc.status != 410:
                raise
            return _WatchEnd(resource_version, num_events, expired=True)
        finally:
            self._active_watch = None
        return _WatchEnd(resource_version, num_events, expired=False)


def _describe(exc: Exception) -> str:
    if isinstance(exc, client.ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def _rbac_hint(exc: Exception) -> str:
    if isinstance(exc, client.ApiException) and exc.status == 403:
        return " (the ServiceAccount needs get/list/watch on endpointslices.discovery.k8s.io)"
    return ""
