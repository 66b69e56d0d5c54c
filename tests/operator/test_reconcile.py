"""One reconciliation on an in-memory API server, on what goes wrong: an object the API
server refuses as invalid (422) is an invalid spec, not an endless retry; an invalid spec
creates nothing, not even the Secrets; a Secret that holds no usable token is reported; a
Secret of the user's without the key gets the key and keeps its type."""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any

import aiohttp
import kopf
import pytest
from kube_fakes import MemoryKube
from kubernetes.aio.client.exceptions import ApiException

from iterserve.operator import admin_token, handlers
from iterserve.operator.admin_token import ROTATE_ANNOTATION, ROTATED_STATUS
from iterserve.operator.reconcile import OperatorSettings, reconcile, unschedulable
from iterserve.operator.spec import SpecError

NS = "demo"
BODY: dict[str, Any] = {
    "apiVersion": "iterserve.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "tiny", "namespace": NS, "uid": "uid-tiny", "generation": 1},
    "spec": {
        "model": {"name": "tiny", "source": {"hostPath": "/models/tiny"}},
        "image": "ghcr.io/example/iterserve:0.2.0",
        "resources": {"gpus": 0},
    },
}


def _reconcile(kube: MemoryKube, body: dict[str, Any] = BODY) -> Any:
    return asyncio.run(reconcile(kube, body, OperatorSettings()))


def _secret(name: str, data: dict[str, str], type_: str = "Opaque") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "type": type_,
        "data": data,
    }


def test_an_object_the_api_server_refuses_is_an_invalid_spec() -> None:
    kube = MemoryKube(refuse=("Deployment",))
    with pytest.raises(SpecError, match=r"the API server refused Deployment tiny: .*bad field"):
        _reconcile(kube)


def test_other_api_errors_are_retried() -> None:
    class Failing(MemoryKube):
        async def create(self, body: dict[str, Any]) -> Any:
            raise ApiException(status=503, reason="unavailable")

    with pytest.raises(ApiException):
        _reconcile(Failing())


@pytest.mark.parametrize(
    "error",
    [ApiException(status=503, reason="unavailable"), aiohttp.ClientConnectionError("reset")],
    ids=["api-error", "connection-error"],
)
def test_a_failing_api_is_tried_again_in_seconds(error: Exception) -> None:
    """An API error or an unreachable API server (restarting): a TemporaryError with the
    operator's short delay, not kopf's 60 s backoff for unexpected errors."""

    class Failing(MemoryKube):
        async def create(self, body: dict[str, Any]) -> Any:
            raise error

    memo = kopf.Memo(kube=Failing(), settings=OperatorSettings())
    with pytest.raises(kopf.TemporaryError) as raised:
        asyncio.run(handlers._reconcile(BODY, kopf.Patch(), memo, permanent=False))  # type: ignore[arg-type]
    assert raised.value.delay == handlers.RETRY_DELAY_S


def test_an_invalid_spec_creates_nothing() -> None:
    kube = MemoryKube()
    body = copy.deepcopy(BODY)
    body["metadata"]["name"] = "1-starts-with-a-digit"
    with pytest.raises(SpecError, match=r"metadata\.name"):
        _reconcile(kube, body)
    assert kube.objects == {}


@pytest.mark.parametrize(
    "token",
    ["not base64!", base64.b64encode(b"\xff\xfe").decode()],
    ids=["not-base64", "not-utf8"],
)
def test_a_secret_without_a_usable_token_is_reported(token: str) -> None:
    kube = MemoryKube()
    kube.objects["Secret", "tiny-admin"] = _secret("tiny-admin", {"token": token})
    with pytest.raises(SpecError, match="Secret tiny-admin: key token"):
        _reconcile(kube)


def test_a_users_secret_without_the_key_gets_it_and_keeps_its_type() -> None:
    kube = MemoryKube()
    kube.objects["Secret", "tiny-admin"] = _secret("tiny-admin", {"other": "eA=="}, "custom/x")
    outcome = _reconcile(kube)
    secret = kube.objects["Secret", "tiny-admin"]
    assert secret["type"] == "custom/x"
    assert set(secret["data"]) == {"other", "token"}
    assert base64.b64decode(secret["data"]["token"])
    assert outcome.status["observedGeneration"] == 1


def test_a_token_no_header_can_carry_is_reported() -> None:
    kube = MemoryKube()
    token = base64.b64encode(b"two words\n").decode()  # one token per line: not two tokens
    kube.objects["Secret", "tiny-admin"] = _secret("tiny-admin", {"token": token})
    with pytest.raises(SpecError, match="whitespace"):
        _reconcile(kube)


def test_a_token_the_pods_refuse_is_reported() -> None:
    # Breaker finding: a non-ASCII token passed the operator (str.isprintable) but the pods'
    # --admin-token-file refuses it (ASCII only): a new pod crash-looped, the others kept the
    # old token and refused every push. CRLF line ends and blank lines stay fine.
    kube = MemoryKube()
    token = base64.b64encode("t\u00f6ken\n".encode()).decode()
    kube.objects["Secret", "tiny-admin"] = _secret("tiny-admin", {"token": token})
    with pytest.raises(SpecError, match=r"Secret tiny-admin: key token.*not ASCII"):
        _reconcile(kube)
    token = base64.b64encode(b"\r\n\r\nnew\r\n\r\nold\r\n").decode()
    kube.objects["Secret", "tiny-admin"] = _secret("tiny-admin", {"token": token})
    _reconcile(kube)


def test_the_timer_warns_once_about_an_invalid_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    warned: list[str] = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append(reason))
    body = copy.deepcopy(BODY)
    body["metadata"]["name"] = "9lives"
    memo = kopf.Memo(kube=MemoryKube(), settings=OperatorSettings())
    for _ in range(3):  # three timer passes, each seeing the status the last one wrote
        patch = kopf.Patch()
        asyncio.run(handlers._reconcile(body, patch, memo, permanent=False))  # type: ignore[arg-type]
        body["status"] = copy.deepcopy(dict(patch["status"]))
    assert warned == ["InvalidSpec"]
    body["spec"]["image"] = "other:1"  # another reason (still the name): warned again
    body["metadata"]["name"] = "9-other"
    asyncio.run(handlers._reconcile(body, kopf.Patch(), memo, permanent=False))  # type: ignore[arg-type]
    assert warned == ["InvalidSpec", "InvalidSpec"]


# -- autoscalers taking over ------------------------------------------------------------------


class KedaWebhookKube(MemoryKube):
    """KEDA's admission webhook: a ScaledObject on a Deployment that an HPA already scales is
    refused (403, as the webhook answers)."""

    async def create(self, body: dict[str, Any]) -> Any:
        if body["kind"] == "ScaledObject":
            target = body["spec"]["scaleTargetRef"]["name"]
            for (kind, _), live in self.objects.items():
                hpa = kind == "HorizontalPodAutoscaler"
                if hpa and live["spec"]["scaleTargetRef"]["name"] == target:
                    message = f"the workload '{target}' is already managed by an hpa"
                    raise ApiException(status=403, reason=message)
        return await super().create(body)


def _with_autoscaling(generation: int, **autoscaling: Any) -> dict[str, Any]:
    body = copy.deepcopy(BODY)
    body["metadata"]["generation"] = generation
    body["spec"]["autoscaling"] = {"enabled": True, **autoscaling}
    return body


def test_switching_from_hpa_to_keda_deletes_the_hpa_first() -> None:
    kube = KedaWebhookKube()
    _reconcile(kube, _with_autoscaling(1, via="hpa"))
    assert ("HorizontalPodAutoscaler", "tiny") in kube.objects
    keda = _with_autoscaling(2, via="keda", prometheusURL="http://prometheus:9090")
    outcome = _reconcile(kube, keda)
    assert ("HorizontalPodAutoscaler", "tiny") not in kube.objects
    assert ("ScaledObject", "tiny") in kube.objects
    assert ("Normal", "Deleted", "HorizontalPodAutoscaler tiny") in outcome.events


@pytest.mark.parametrize(
    "before",
    [
        {"replicas": 0},  # spec.replicas 0, then autoscaling on
        {"autoscaling": {"enabled": True, "via": "keda", "minReplicas": 0,
                         "prometheusURL": "http://prometheus:9090"}},  # scaled to zero
    ],
)  # fmt: skip
def test_an_hpa_taking_over_a_deployment_at_zero_starts_it_at_min_replicas(
    before: dict[str, Any],
) -> None:
    """An HPA never scales a Deployment up from 0: the operator starts it at minReplicas."""
    kube = MemoryKube()
    first = copy.deepcopy(BODY)
    first["spec"].update(before)
    _reconcile(kube, first)
    kube.objects["Deployment", "tiny"]["spec"]["replicas"] = 0  # where KEDA or the spec left it
    _reconcile(kube, _with_autoscaling(2, via="hpa", minReplicas=2))
    assert kube.objects["Deployment", "tiny"]["spec"]["replicas"] == 2
    # Then the HPA owns the count: the next pass leaves what it set alone.
    kube.objects["Deployment", "tiny"]["spec"]["replicas"] = 3
    _reconcile(kube, _with_autoscaling(2, via="hpa", minReplicas=2))
    assert kube.objects["Deployment", "tiny"]["spec"]["replicas"] == 3


def test_scale_to_zero_is_left_at_zero() -> None:
    kube = MemoryKube()
    body = _with_autoscaling(1, via="keda", minReplicas=0, prometheusURL="http://prometheus:9090")
    _reconcile(kube, body)
    kube.objects["Deployment", "tiny"]["spec"]["replicas"] = 0  # KEDA scaled it to zero
    _reconcile(kube, body)
    assert kube.objects["Deployment", "tiny"]["spec"]["replicas"] == 0


def _unschedulable_pod(name: str, message: str) -> dict[str, Any]:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    condition["message"] = message
    return {"metadata": {"name": name}, "status": {"conditions": [condition]}}


def test_pods_the_scheduler_cannot_place_are_named_in_progressing() -> None:
    """Scaled past the cluster's GPUs: Progressing says Unschedulable with the scheduler's own
    message (the cluster tier checks it on a real scheduler); odd objects are skipped."""
    message = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    pods = [
        _unschedulable_pod("tiny-b", message),
        _unschedulable_pod("tiny-a", message),
        {**_unschedulable_pod("x", ""), "metadata": {"name": "tiny-c", "deletionTimestamp": "t"}},
        {"metadata": {"name": "tiny-e"}, "status": {"conditions": "odd"}},
        {"metadata": {"name": "tiny-d"}, "status": {"conditions": ["odd", {"type": "Ready"}]}},
    ]
    assert unschedulable(pods) == [("tiny-a", message), ("tiny-b", message)]

    class Pending(MemoryKube):
        async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Any]:
            return pods

    kube = Pending()
    _reconcile(kube)
    kube.objects["Deployment", "tiny"]["status"] = {"replicas": 3, "readyReplicas": 1}
    kube.objects["Deployment", "tiny"]["spec"]["replicas"] = 3
    status = _reconcile(kube).status
    (progressing,) = [c for c in status["conditions"] if c["type"] == "Progressing"]
    assert (progressing["status"], progressing["reason"]) == ("True", "Unschedulable")
    assert progressing["message"] == f"2 pods cannot be scheduled (tiny-a: {message})"


def test_the_routers_service_account_exists_before_its_deployment() -> None:
    """Created in that order (a Deployment whose ServiceAccount is missing gets a
    FailedCreate event from the ReplicaSet controller, seen on a real cluster)."""
    created: list[str] = []

    class Recording(MemoryKube):
        async def create(self, body: dict[str, Any]) -> Any:
            created.append(f"{body['kind']}/{body['metadata']['name']}")
            return await super().create(body)

    _reconcile(Recording())
    position = {name: i for i, name in enumerate(created)}
    assert position["ServiceAccount/tiny-router"] < position["Deployment/tiny-router"]
    assert position["RoleBinding/tiny-router"] < position["Deployment/tiny-router"]


# -- admin token rotation, NetworkPolicies switched off -----------------------------------


def _tokens(kube: MemoryKube) -> list[str]:
    return base64.b64decode(kube.objects["Secret", "tiny-admin"]["data"]["token"]).decode().split()


def test_the_rotation_annotation_rotates_once_per_value_keeping_the_previous_token() -> None:
    """No ready pod here (the push with both tokens is test_real_push.py's): NEW\\nCURRENT is
    written once per annotation value, and the next value drops the oldest."""
    kube = MemoryKube()
    _reconcile(kube)
    (first,) = _tokens(kube)
    body = copy.deepcopy(BODY)
    body["metadata"]["annotations"] = {ROTATE_ANNOTATION: "2026-12-03"}
    outcome = _reconcile(kube, body)
    second, previous = _tokens(kube)
    assert previous == first and second != first
    assert outcome.status[ROTATED_STATUS] == "2026-12-03"
    assert ("Normal", "AdminTokenRotated") in [(t, r) for t, r, _ in outcome.events]
    body["status"] = outcome.status  # what kopf writes: the same value is not rotated again
    assert ROTATED_STATUS not in _reconcile(kube, body).status
    assert _tokens(kube) == [second, first]
    body["metadata"]["annotations"][ROTATE_ANNOTATION] = "again"
    _reconcile(kube, body)
    third, previous = _tokens(kube)
    assert previous == second and third not in (first, second)


def test_a_reconcile_that_predates_the_rotations_status_does_not_rotate_again() -> None:
    """A resync right after the rotating reconcile, its body without the status that one
    wrote (seen on the local control plane): the Secret says the value was acted on, so the
    previous token the pods still hold is kept, and the status catches up."""
    kube = MemoryKube()
    _reconcile(kube)
    (first,) = _tokens(kube)
    body = copy.deepcopy(BODY)
    body["metadata"]["annotations"] = {ROTATE_ANNOTATION: "r1"}
    _reconcile(kube, body)
    second, previous = _tokens(kube)
    assert previous == first
    stale = _reconcile(kube, body)  # the same body: no adminTokenRotation in its status
    assert _tokens(kube) == [second, first]
    assert stale.status[ROTATED_STATUS] == "r1"
    assert "AdminTokenRotated" not in [r for _, r, _ in stale.events]


def test_generated_tokens_never_start_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token starting with ``-`` breaks ``--admin-token TOKEN`` (argparse takes it for an
    option: a CI run failed so); the generator draws again, for every Secret it creates."""
    draws = iter(["-dash-first", "-again", "fine-token-1234", "-x", "ok-token-5678"])
    monkeypatch.setattr(admin_token.secrets, "token_urlsafe", lambda _n: next(draws))
    assert admin_token.new_token() == "fine-token-1234"
    assert admin_token.new_token() == "ok-token-5678"


def test_network_policies_switched_off_are_deleted() -> None:
    kube = MemoryKube()
    _reconcile(kube)
    assert {("NetworkPolicy", "tiny-server"), ("NetworkPolicy", "tiny-router")} <= set(kube.objects)
    for name in ("tiny-server", "tiny-router"):  # owned, as apply() adopts them
        kube.objects["NetworkPolicy", name]["metadata"]["ownerReferences"] = [{"uid": "uid-tiny"}]
    body = copy.deepcopy(BODY)
    body["spec"]["networkPolicy"] = {"enabled": False}
    outcome = _reconcile(kube, body)
    assert not any(kind == "NetworkPolicy" for kind, _ in kube.objects)
    assert ("Normal", "Deleted", "NetworkPolicy tiny-server") in outcome.events


def test_restart_counts_sum_the_containers_of_pods_not_terminating() -> None:
    from iterserve.operator.reconcile import restart_counts

    def pod(name: Any, *counts: Any, deleting: bool = False) -> dict[str, Any]:
        meta = {"name": name, **({"deletionTimestamp": "t"} if deleting else {})}
        return {"metadata": meta,
                "status": {"containerStatuses": [{"restartCount": c} for c in counts]}}  # fmt: skip

    pods = [pod("a", 1, 2), pod("b"), pod("c", 4, deleting=True), pod(None, 1), pod("d", "x")]
    evicted = {"metadata": {"name": "f"}, "status": {"phase": "Failed"}}
    assert restart_counts([*pods, {"metadata": {"name": "e"}, "status": None}, evicted]) == {
        "a": 3, "b": 0, "d": 0, "e": 0,
    }  # fmt: skip


def test_a_pod_turning_ready_mid_reconcile_is_never_counted_before_it_is_pushed_to() -> None:
    """The pod list shows no ready pod, then the pod turns ready and the Deployment counts it
    (the race a real cluster ran into): the status must not say one ready replica beside "no
    ready pod to apply the settings to". It was so when the Deployment was read after the
    pushes; now its counts are read before the pods."""

    class TurningReady(MemoryKube):
        async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Any]:
            if ("Deployment", "tiny") in self.objects:
                self.objects["Deployment", "tiny"]["status"] = {"replicas": 1, "readyReplicas": 1}
            return []

    kube = TurningReady()
    _reconcile(kube)  # creates the Deployment
    status = _reconcile(kube).status  # the pod turns ready during this one
    applied = next(c for c in status["conditions"] if c["type"] == "SchedulerConfigApplied")
    assert (status["readyReplicas"], applied["reason"]) == (0, "NoReadyPods")
    assert _reconcile(kube).status["readyReplicas"] == 1  # the next one counts it


def test_a_resync_beside_a_change_or_behind_a_newer_generation_does_nothing() -> None:
    """kopf runs the resync timer beside the change handlers: a resync while the change's
    reconcile runs, or one whose body predates the newest generation reconciled, must not
    reconcile (it pushed the old settings over the new ones, which pods then took as newer
    versions)."""
    listing = asyncio.Event()
    release = asyncio.Event()

    class Held(MemoryKube):
        async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Any]:
            listing.set()
            await release.wait()
            return []

    newer = copy.deepcopy(BODY)
    newer["metadata"]["generation"] = 2

    async def scenario() -> tuple[kopf.Patch, kopf.Patch, kopf.Patch]:
        memo = kopf.Memo(kube=Held(), settings=OperatorSettings())
        change, beside, behind = kopf.Patch(), kopf.Patch(), kopf.Patch()
        running = asyncio.create_task(handlers._reconcile(newer, change, memo, permanent=True))
        await listing.wait()
        resync = handlers._reconcile(BODY, beside, memo, permanent=False)  # while it runs
        await asyncio.wait_for(resync, 5)  # (it would wait for the held list, then time out)
        release.set()
        await running
        await handlers._reconcile(BODY, behind, memo, permanent=False)  # generation 1 < 2
        return change, beside, behind

    change, beside, behind = asyncio.run(scenario())
    assert change.status["observedGeneration"] == 2
    assert (dict(beside), dict(behind)) == ({}, {})
