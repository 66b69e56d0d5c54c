"""Why a running operator does nothing, said at warning level: kopf pauses silently (debug
level only) while mandatory peering lacks its CRD or its object, and serves nothing without
the LLMDeployment CRD. The checks against KMock, the throttled warnings on a fake clock, and
the operator itself (kopf with ``iterserve operator run``'s peering arguments) against KMock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kmock_cluster import VERBS, cluster
from kubernetes.aio import client
from kubernetes.aio.client.exceptions import ApiException

from iterserve.operator.blockers import Watch, find_blockers, warn_while_blocked
from iterserve.operator.kube import Kube
from iterserve.operator.main import PEERING_NAME, peering_options

LLMD = "iterserve.io/v1alpha1/llmdeployments"
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"
PEERINGS = "kopf.dev/v1/kopfpeerings"
_KINDS = {
    LLMD: ("LLMDeployment", True),
    CLUSTER_PEERINGS: ("ClusterKopfPeering", False),
    PEERINGS: ("KopfPeering", True),
}
CRD_MISSING = (
    "the LLMDeployment CRD (llmdeployments.iterserve.io) is not installed, so there is nothing "
    "to watch: install it (kubectl apply -f crds/llmdeployments.iterserve.io.yaml; the Helm "
    "chart installs it)"
)
STANDALONE_HINT = "or run with --standalone if no other instance of the operator can run"
OBJECT_MISSING = (
    "kopf's peering is on (no --standalone) but no ClusterKopfPeering named iterserve exists, "
    "so kopf pauses every watch until it does: create it (charts/iterserve/templates/"
    "peering.yaml, which the Helm chart installs, or echo '{apiVersion: kopf.dev/v1, kind: "
    f"ClusterKopfPeering, metadata: {{name: iterserve}}}}' | kubectl apply -f -), {STANDALONE_HINT}"
)
PEERING_CRD_MISSING = (
    "kopf's peering is on (no --standalone) but its CRD clusterkopfpeerings.kopf.dev is not "
    "installed, so kopf pauses every watch: install it (kubectl apply -f "
    "crds/clusterkopfpeerings.kopf.dev.yaml) and create the ClusterKopfPeering named iterserve "
    f"(charts/iterserve/templates/peering.yaml; the Helm chart installs both), {STANDALONE_HINT}"
)


def _peering(kind: str, namespace: str | None = None, name: str = PEERING_NAME) -> dict[str, Any]:
    meta = {"name": name} | ({"namespace": namespace} if namespace else {})
    return {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": meta}


def _manifest(message: str) -> dict[str, Any]:
    """The object of the ``echo '...' | kubectl apply -f -`` a message suggests."""
    match = re.search(r"echo '([^']*)' \| kubectl apply -f -", message)
    assert match, message
    return dict(yaml.safe_load(match[1]))


def _path(obj: dict[str, Any]) -> str:
    plural = f"{obj['kind'].lower()}s"
    namespace = obj["metadata"].get("namespace")
    return f"/apis/kopf.dev/v1/{f'namespaces/{namespace}/' if namespace else ''}{plural}"


@contextlib.asynccontextmanager
async def _kube(
    served: set[str], objects: list[dict[str, Any]]
) -> AsyncIterator[tuple[kmock.KubernetesEmulator, Kube]]:
    """KMock serving ``served`` (``group/version/plural``) and holding ``objects`` (peering
    objects), and the operator's client on it."""
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
        for resource in served:
            kind, namespaced = _KINDS[resource]
            k8s.resources[resource] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=VERBS
            )
        for obj in objects:
            await k8s.post(_path(obj), json=obj)
        api = client.ApiClient(client.Configuration(host=str(server.url).rstrip("/")))
        try:
            yield k8s, Kube(api)
        finally:
            await api.close()


CLUSTER_WIDE = Watch(peering=PEERING_NAME)
ALL = {LLMD, CLUSTER_PEERINGS, PEERINGS}


@pytest.mark.parametrize(
    ("served", "objects", "watch", "expected"),
    [
        (ALL, [_peering("ClusterKopfPeering")], CLUSTER_WIDE, []),
        (ALL, [], CLUSTER_WIDE, [OBJECT_MISSING]),
        # A KopfPeering (namespaced) is not the cluster-wide operator's, nor is another
        # kopf operator's peering object.
        (ALL, [_peering("KopfPeering", "a")], CLUSTER_WIDE, [OBJECT_MISSING]),
        (ALL, [_peering("ClusterKopfPeering", name="default")], CLUSTER_WIDE, [OBJECT_MISSING]),
        ({LLMD}, [], CLUSTER_WIDE, [PEERING_CRD_MISSING]),
        (set(), [], CLUSTER_WIDE, [CRD_MISSING, PEERING_CRD_MISSING]),
        # Standalone: no peering to check.
        ({LLMD}, [], Watch(), []),
        (set(), [], Watch(), [CRD_MISSING]),
    ],
    ids=["ok", "no-peering-object", "only-namespaced-peering", "other-peering", "no-peering-crd",
         "no-crds", "standalone", "standalone-no-crd"],
)  # fmt: skip
def test_find_blockers_cluster_wide(
    served: set[str], objects: list[dict[str, Any]], watch: Watch, expected: list[str]
) -> None:
    async def scenario() -> list[str]:
        async with _kube(served, objects) as (_, kube):
            return await find_blockers(kube, watch)

    assert asyncio.run(scenario()) == expected


def test_the_suggested_peering_object_unblocks() -> None:
    """Applied as the message says, the object is the one kopf waits for."""

    async def scenario() -> None:
        async with _kube(ALL, []) as (k8s, kube):
            for watch in (CLUSTER_WIDE, Watch(("a",), PEERING_NAME)):
                (message,) = await find_blockers(kube, watch)
                obj = _manifest(message)
                assert obj == _peering(obj["kind"], obj["metadata"].get("namespace"))
                await k8s.post(_path(obj), json=obj)
                assert await find_blockers(kube, watch) == []

    asyncio.run(scenario())


def test_find_blockers_per_watched_namespace() -> None:
    """Namespaced: the KopfPeering of each watched namespace; the CRD said once; namespace
    patterns, which kopf resolves by listing namespaces, not checked."""

    async def scenario() -> list[str]:
        async with _kube({PEERINGS}, [_peering("KopfPeering", "a")]) as (_, kube):
            return await find_blockers(kube, Watch(("a", "b", "c", "team-*"), PEERING_NAME))

    crd, b, c = asyncio.run(scenario())
    assert crd == CRD_MISSING
    for namespace, message in (("b", b), ("c", c)):
        assert message.startswith(
            f"kopf's peering is on (no --standalone) but no KopfPeering named iterserve exists "
            f"in namespace {namespace}, so kopf pauses every watch until it does"
        ), message
        assert _manifest(message) == _peering("KopfPeering", namespace)


def test_find_blockers_names_a_forbidden_list() -> None:
    class Forbidden(Kube):
        def __init__(self) -> None:
            pass

        async def list_custom(
            self, group: str, version: str, plural: str, namespace: str | None = None, **_: Any
        ) -> list[Any]:
            raise ApiException(status=403, reason="Forbidden")

    assert asyncio.run(find_blockers(Forbidden(), Watch(("a",), PEERING_NAME))) == [
        "the operator may not list llmdeployments.iterserve.io in namespace a (403 Forbidden): "
        "grant it list, watch and patch (the Helm chart's RBAC does)",
        "the operator may not list kopfpeerings.kopf.dev in namespace a (403 Forbidden): grant "
        "it list, watch and patch (the Helm chart's RBAC does)",
    ]


class _Stop(BaseException):
    """Ends :func:`warn_while_blocked` (it runs until cancelled)."""


def test_warnings_at_start_every_30_s_and_on_change(caplog: pytest.LogCaptureFixture) -> None:
    """Checks every 10 s: warned at once, not again at 10 and 20 s, again at 30 s, at once
    when the blockers change, an info once when none is left; a failing check is warned."""
    results: list[list[str] | Exception] = [
        ["a"], ["a"], ["a"], ["a"], ["a", "b"], ["a", "b"], [], [], OSError("refused"), [],
    ]  # fmt: skip
    now = [0.0]
    log: list[tuple[float, int, str]] = []

    async def check() -> list[str]:
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    async def sleep(seconds: float) -> None:
        log.extend((now[0], r.levelno, r.getMessage()) for r in caplog.records)
        caplog.clear()
        if not results:
            raise _Stop
        now[0] += seconds

    caplog.set_level(logging.INFO, logger="iterserve.operator.blockers")
    with pytest.raises(_Stop):
        asyncio.run(warn_while_blocked(check, clock=lambda: now[0], sleep=sleep))
    w, i = logging.WARNING, logging.INFO
    assert log == [
        (0.0, w, "Nothing is reconciled: a."),
        (30.0, w, "Nothing is reconciled: a."),
        (40.0, w, "Nothing is reconciled: a."),
        (40.0, w, "Nothing is reconciled: b."),
        (60.0, i, "Resolved, kopf resumes: a; b."),
        (80.0, w, "Nothing is reconciled: the operator could not ask the Kubernetes API why: "
                  "OSError('refused')."),
        (90.0, i, "Resolved, kopf resumes: the operator could not ask the Kubernetes API why: "
                  "OSError('refused')."),
    ]  # fmt: skip


# -- the operator itself, against KMock --------------------------------------------------------

NS = "serving"
API = f"/apis/iterserve.io/v1alpha1/namespaces/{NS}/llmdeployments"
RESOURCE: dict[str, Any] = {
    "apiVersion": "iterserve.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "chat", "namespace": NS, "uid": "uid-chat", "generation": 1,
                 "resourceVersion": "1"},
    "spec": {
        "model": {"name": "smol", "source": {"hostPath": "/models/smol"}},
        "image": "iterserve:test",
        "resources": {"gpus": 0},
    },
}  # fmt: skip
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/chat"


async def _until(check: Any, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "iterserve.operator.blockers" and r.levelno == logging.WARNING
    ]


def test_operator_warns_while_the_peering_object_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Peering on (as the chart runs it) without the ClusterKopfPeering: a warning names it;
    the object created as the warning says, kopf resumes and reconciles."""
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        async with cluster(tmp_path, peering=True, peering_object=False) as k8s:
            await k8s.post(API, json=RESOURCE)

            async def warned() -> bool:
                return bool(_warnings(caplog))

            await _until(warned, "a warning")
            assert _warnings(caplog) == [f"Nothing is reconciled: {OBJECT_MISSING}."]
            assert (await k8s.get(DEPLOYMENT)).status == 404  # paused
            peering = _manifest(OBJECT_MISSING)
            await k8s.post(_path(peering), json={**peering, "metadata": {
                **peering["metadata"], "resourceVersion": "1"}})  # fmt: skip

            async def reconciled() -> bool:
                return bool((await k8s.get(DEPLOYMENT)).status == 200)

            await _until(reconciled, "the Deployment, once the peering object exists")

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_standalone_needs_no_peering_crd(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``--standalone`` means no peering at all: without the peering CRDs the operator
    reconciles (kopf given a peering name made peering mandatory and paused it for good) and
    warns about nothing."""
    caplog.set_level(logging.INFO)
    assert "peering_name" not in peering_options(standalone=True)

    async def scenario() -> None:
        unserved = (CLUSTER_PEERINGS, PEERINGS)
        async with cluster(tmp_path, peering=False, unserved=unserved) as k8s:
            await k8s.post(API, json=RESOURCE)

            async def reconciled() -> bool:
                return bool((await k8s.get(DEPLOYMENT)).status == 200)

            await _until(reconciled, "the Deployment")

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert _warnings(caplog) == []


def test_operator_warns_without_the_llmdeployment_crd(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        async with cluster(tmp_path, peering=True, unserved=(LLMD,)):

            async def warned() -> bool:
                return bool(_warnings(caplog))

            await _until(warned, "a warning")

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert _warnings(caplog) == [f"Nothing is reconciled: {CRD_MISSING}."]


@pytest.fixture(autouse=True)
def _quiet_kopf() -> None:
    import kopf

    kopf.configure(verbose=False)
