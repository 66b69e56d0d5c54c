"""The operator's Kubernetes calls, over the official client's asyncio API (``kubernetes.aio``).

Only requests both a real API server and KMock accept: get, create, JSON merge patch, list
(label selectors are filtered here too: KMock ignores them). Objects go in and come out as
plain mappings (the JSON the API serves), never the client's models.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.aio import client
from kubernetes.aio.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"
# What the operator applied last to an object (JSON), for three-way patches.
LAST_APPLIED = "iterserve.io/last-applied"

# kind -> (API class, the snake_case name in its methods), for namespaced built-in kinds.
_TYPED: dict[str, tuple[str, str]] = {
    "ConfigMap": ("CoreV1Api", "config_map"),
    "Secret": ("CoreV1Api", "secret"),
    "Service": ("CoreV1Api", "service"),
    "ServiceAccount": ("CoreV1Api", "service_account"),
    "Pod": ("CoreV1Api", "pod"),
    "Deployment": ("AppsV1Api", "deployment"),
    "Role": ("RbacAuthorizationV1Api", "role"),
    "RoleBinding": ("RbacAuthorizationV1Api", "role_binding"),
    "PodDisruptionBudget": ("PolicyV1Api", "pod_disruption_budget"),
    "HorizontalPodAutoscaler": ("AutoscalingV2Api", "horizontal_pod_autoscaler"),
    "NetworkPolicy": ("NetworkingV1Api", "network_policy"),
}
# kind -> plural, for custom resources (served by CustomObjectsApi).
_CUSTOM = {
    "ScaledObject": "scaledobjects",
    "LLMDeployment": "llmdeployments",
    "InferencePool": "inferencepools",
}


def is_not_found(e: BaseException) -> bool:
    return isinstance(e, ApiException) and e.status == 404


async def _raw(call: Any) -> Any:
    """The decoded JSON of a ``*_without_preload_content`` call."""
    response = await call
    try:
        if response.status >= 400:
            raise ApiException(status=response.status, reason=await response.text())
        return json.loads(await response.read())
    finally:
        response.release()


class Kube:
    """Typed calls for the kinds the operator owns, by ``apiVersion``/``kind`` of a body."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _typed(self, kind: str, verb: str) -> Any:
        api_class, name = _TYPED[kind]
        api = getattr(client, api_class)(self.api)
        return getattr(api, f"{verb}_namespaced_{name}_without_preload_content")

    def _custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any | None:
        """The object, or None when it does not exist."""
        try:
            if kind in _TYPED:
                return await _raw(self._typed(kind, "read")(name, namespace))
            group, version = api_version.split("/")
            call = self._custom().get_namespaced_custom_object_without_preload_content(
                group, version, namespace, _CUSTOM[kind], name
            )
            return await _raw(call)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def create(self, body: dict[str, Any]) -> Any:
        kind, namespace = body["kind"], body["metadata"]["namespace"]
        if kind in _TYPED:
            return await _raw(self._typed(kind, "create")(namespace, body))
        group, version = body["apiVersion"].split("/")
        call = self._custom().create_namespaced_custom_object_without_preload_content(
            group, version, namespace, _CUSTOM[kind], body
        )
        return await _raw(call)

    async def patch(self, body: dict[str, Any]) -> Any:
        """A JSON merge patch of ``body`` onto the object of its kind, namespace and name."""
        kind, meta = body["kind"], body["metadata"]
        if kind in _TYPED:
            call = self._typed(kind, "patch")(
                meta["name"], meta["namespace"], body, _content_type=MERGE_PATCH
            )
            return await _raw(call)
        group, version = body["apiVersion"].split("/")
        call = self._custom().patch_namespaced_custom_object_without_preload_content(
            group, version, meta["namespace"], _CUSTOM[kind], meta["name"], body,
            _content_type=MERGE_PATCH,
        )  # fmt: skip
        return await _raw(call)

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete the object (gone already is fine)."""
        try:
            if kind in _TYPED:
                await _raw(self._typed(kind, "delete")(name, namespace))
                return
            group, version = api_version.split("/")
            call = self._custom().delete_namespaced_custom_object_without_preload_content(
                group, version, namespace, _CUSTOM[kind], name
            )
            await _raw(call)
        except ApiException as e:
            if e.status != 404:
                raise

    async def list_custom(
        self,
        group: str,
        version: str,
        plural: str,
        namespace: str | None = None,
        *,
        name: str | None = None,
        limit: int | None = None,
    ) -> list[Any]:
        """Objects of a custom resource in ``namespace`` (every namespace when None): only
        the one named ``name`` when given, at most ``limit`` (a real API server honours both;
        KMock ignores them, so ``name`` is filtered here too).

        Raises:
            ApiException: 404 when the API server does not serve the resource (its CRD is not
                installed), 403 when the operator may not list it.
        """
        api = self._custom()
        options: dict[str, Any] = {"limit": limit}
        if name is not None:
            options["field_selector"] = f"metadata.name={name}"
        if namespace is None:
            call = api.list_cluster_custom_object_without_preload_content(
                group, version, plural, **options
            )
        else:
            call = api.list_namespaced_custom_object_without_preload_content(
                group, version, namespace, plural, **options
            )
        items = (await _raw(call)).get("items") or []
        return [i for i in items if name is None or (i.get("metadata") or {}).get("name") == name]

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Any]:
        """Objects of ``kind`` in ``namespace`` carrying all ``labels``."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = await _raw(self._typed(kind, "list")(namespace, label_selector=selector))
        return [
            item
            for item in data.get("items", [])
            if all(
                item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items()
            )
        ]


def is_subset(desired: Any, live: Any) -> bool:
    """Whether ``live`` already has every value of ``desired`` (what the API server adds,
    defaults and status, is ignored; a list must match item by item)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and is_subset(v, live[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, x) for d, x in zip(desired, live, strict=True))
        )
    if isinstance(desired, int | float) and isinstance(live, int | float):
        return desired == live
    return bool(desired == live) or str(desired) == str(live)


# Keys the operator hands over rather than deletes when it stops setting them: an
# autoscaler owns a Deployment's replica count once autoscaling is on.
HANDED_OVER = (("spec", "replicas"),)


def _removals(last: Any, desired: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) nulls that delete what ``last`` set and ``desired``
    no longer does (a merge patch replaces lists whole, so only mapping keys need them)."""
    if not isinstance(last, dict) or not isinstance(desired, dict):
        return {}
    removals: dict[str, Any] = {}
    for key, value in last.items():
        if key not in desired:
            if (*path, key) not in HANDED_OVER:
                removals[key] = None
        elif isinstance(value, dict) and (nested := _removals(value, desired[key], (*path, key))):
            removals[key] = nested
    return removals


def _merge(patch: dict[str, Any], removals: dict[str, Any]) -> dict[str, Any]:
    out = dict(patch)
    for key, value in removals.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) else value
    return out


async def apply(kube: Kube, body: dict[str, Any]) -> str:
    """Create ``body``, or merge-patch it onto the live object when that drifted; what was
    done: ``created``, ``patched`` or ``unchanged`` (running it twice changes nothing).

    Three-way, as ``kubectl apply``: the object carries what was applied last (annotation
    :data:`LAST_APPLIED`), so a key the operator stops setting (a node selector taken out of
    the spec, an init container no longer needed) is deleted, while keys others set (the
    API server's defaults, another controller's annotations) are left alone.
    """
    meta = body["metadata"]
    last_applied = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body = {**body, "metadata": {**meta, "annotations": {**meta.get("annotations", {})}}}
    body["metadata"]["annotations"][LAST_APPLIED] = last_applied
    where = (body["apiVersion"], body["kind"], meta["namespace"], meta["name"])
    live = await kube.get(*where)
    if live is None:
        try:
            await kube.create(body)
            return "created"
        except ApiException as e:
            if e.status != 409:  # 409: created meanwhile (a timer and a handler at once)
                raise
        live = await kube.get(*where)
    comparable = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
    if is_subset(comparable, live):
        return "unchanged"
    previous = ((live or {}).get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        last = json.loads(previous) if previous else {}
    except ValueError:
        last = {}
    await kube.patch(_merge(body, _removals(last, json.loads(last_applied))))
    return "patched"
