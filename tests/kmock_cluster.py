"""KMock (the kopf author's Kubernetes API mock) serving what the operator uses, and the
operator's real kopf handlers running against it in the test's event loop.

Shared by tests/operator/test_operator_e2e.py and tests/packaging/test_chart.py (which records
every request the operator makes to check the chart's RBAC). KMock has no uid, generation or
resourceVersion, no garbage collector and no controllers: the tests play those parts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
import kopf
import yaml

from iterserve.operator.handlers import build_registry
from iterserve.operator.main import PEERING_NAME, peering_options
from iterserve.operator.reconcile import OperatorSettings

# The operator's bearer token: every request carrying it is the operator's (kopf's or its
# client's), the tests' own requests carry none.
TOKEN = "t"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


class LeanEmulator(kmock.KubernetesEmulator):
    """KMock that drops each request from its own log once answered, and keeps it in
    ``served`` (for the tests' assertions) instead.

    KMock 0.8 finds the reaction for a new request by asking each reaction whether it sees
    it (``request in reaction``), and a reaction answers by filtering every request logged
    so far: each request costs time in the number served before it, the whole run their
    square. The operator's runs (a few thousand requests) spent most of their CPU there: a
    reconcile pass of ~20 API calls went from 1 s to 10 s over a minute's run, and the
    tests' convergence with it. Requests in flight (a watch stream) stay in the log as
    KMock needs them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served: list[kmock.Request] = []

    async def _handle(self, request: kmock.Request) -> Any:
        try:
            return await super()._handle(request)
        finally:
            self.served.append(request)
            log = self._requests
            # By identity, newest first (a Request's == compares as a pattern).
            for idx in range(len(log) - 1, -1, -1):
                if log[idx] is request:
                    del log[idx]
                    break


class VersionedEmulator(LeanEmulator):
    """KMock that gives every created or patched object a new ``metadata.resourceVersion``,
    as the API server does. kopf waits after its own patches for the watch event carrying the
    version its patch returned; with KMock's constant version it takes the next event, an older
    state of the object, for it, and handles an old spec again (a slow catch-up under load).

    A JSON patch whose ``test`` of the resourceVersion fails (kopf's optimistic finalizer
    patches, on a stale body) is answered 422, as the API server answers it; KMock answered
    500, which kopf retried with the same stale patch for about a minute."""

    _next_version = 1

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE) and isinstance(
            request.data, dict
        ):
            self._next_version += 1
            request.data.setdefault("metadata", {})["resourceVersion"] = str(self._next_version)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e


@contextlib.asynccontextmanager
async def cluster(
    tmp_path: Path,
    *,
    peering: bool = False,
    peering_object: bool = True,
    unserved: Collection[str] = (),
    versioned: bool = False,
    resync_interval_s: float = 0.5,
) -> AsyncIterator[LeanEmulator]:
    """KMock serving the resources the operator uses, and the operator running against it
    (cluster-wide, resync every ``resync_interval_s``) with the peering arguments of
    ``iterserve operator run`` (:func:`peering_options`). ``peering``: kopf's peering on, as
    the chart runs the operator (the ClusterKopfPeering ``iterserve`` exists unless
    ``peering_object`` is false); otherwise ``--standalone``. ``unserved``: resources
    (``group/version/plural``) KMock does not serve, as when their CRD is not installed.
    ``versioned``: objects get a new resourceVersion on every change
    (:class:`VersionedEmulator`)."""
    emulator = VersionedEmulator() if versioned else LeanEmulator()
    async with emulator as k8s, kmock.Server(k8s) as server:
        if "iterserve.io/v1alpha1/llmdeployments" not in unserved:
            k8s.resources["iterserve.io/v1alpha1/llmdeployments"] = kmock.ResourceInfo(
                kind="LLMDeployment", namespaced=True, subresources={"status"}, verbs=VERBS
            )
        # What kopf's own machinery discovers before it watches (CRDs, namespaces, events),
        # kopf's peering, KEDA's ScaledObject and GAIE's InferencePool.
        for resource, kind, namespaced in (
            ("v1/pods", "Pod", True),
            ("v1/events", "Event", True),
            ("v1/namespaces", "Namespace", False),
            (
                "apiextensions.k8s.io/v1/customresourcedefinitions",
                "CustomResourceDefinition",
                False,
            ),
            ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False),
            ("keda.sh/v1alpha1/scaledobjects", "ScaledObject", True),
            ("inference.networking.k8s.io/v1/inferencepools", "InferencePool", True),
        ):
            if resource not in unserved:
                k8s.resources[resource] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs=VERBS
                )
        if peering and peering_object:
            await k8s.post(
                "/apis/kopf.dev/v1/clusterkopfpeerings",
                json={
                    "apiVersion": "kopf.dev/v1",
                    "kind": "ClusterKopfPeering",
                    "metadata": {"name": PEERING_NAME, "resourceVersion": "1"},
                },
            )
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump({
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "mock", "cluster": {"server": str(server.url)}}],
                "users": [{"name": "operator", "user": {"token": TOKEN}}],
                "contexts": [{"name": "c", "context": {"cluster": "mock", "user": "operator"}}],
                "current-context": "c",
            })
        )  # fmt: skip
        stop = asyncio.Event()
        memo = kopf.Memo(kubeconfig=str(kubeconfig), settings=OperatorSettings("router:test"))
        task = asyncio.create_task(
            kopf.operator(
                registry=build_registry(resync_interval_s=resync_interval_s),
                **peering_options(standalone=not peering),
                clusterwide=True,  # KMock 0.8 cannot list /api/v1/namespaces (500)
                memo=memo,
                stop_flag=stop,
            )
        )
        try:
            yield k8s
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
