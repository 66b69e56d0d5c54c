"""The operator end to end: kopf running the handlers against KMock (the kopf author's
Kubernetes API mock), simulated replicas as the pods. The test plays the API server's and the
controller manager's parts KMock does not: it bumps ``metadata.generation`` on spec changes,
creates the Pod objects of running replicas (``status.podIP`` 127.0.0.1, the replica's port
as the container port ``http``), and has no garbage collector."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import kmock
import kopf
import pytest
import yaml
from kmock_cluster import cluster
from server_utils import Server, free_port, run_server
from sim_profiles import make_profile, write_profile

from iterserve.operator.builders import selector
from iterserve.operator.spec import desired_settings, parse_spec, settings_hash_of

NS = "serving"
NAME = "chat"
API = f"/apis/iterserve.io/v1alpha1/namespaces/{NS}/llmdeployments"
SPEC: dict[str, Any] = {
    "model": {"name": "smol", "source": {"hostPath": "/models/smol"}},
    "image": "iterserve:test",
    "replicas": 2,
    "resources": {"gpus": 0},
    "scheduler": {"maxNumSeqs": 32, "maxNumBatchedTokens": 512, "chunkSize": 256},
    "slaTiers": [
        {"name": "premium", "priority": 0, "ttftTargetMs": 200},
        {"name": "standard", "priority": 1},
    ],
}
# The pods' own flags (what the Deployment's args would set, minus the model).
REPLICA_FLAGS = ("--max-model-len", "2048", "--swap-space", "1")


def _resource(name: str, spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "iterserve.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": generation,
            "resourceVersion": "1",  # kopf's patches test it; KMock sets none
        },
        "spec": spec,
    }


def _pod(name: str, server: Server) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": selector(NAME, "server")},
        "spec": {
            "containers": [
                {"name": "server", "ports": [{"name": "http", "containerPort": _port(server)}]}
            ]
        },
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _port(server: Server) -> int:
    port = urlparse(server.url).port
    assert port is not None
    return port


async def _get(k8s: kmock.KubernetesEmulator, path: str) -> Any:
    response = await k8s.get(path)
    return await response.json() if response.status == 200 else None


async def _wait_for(k8s: kmock.KubernetesEmulator, path: str, what: str) -> Any:
    deadline = time.monotonic() + 20
    while (obj := await _get(k8s, path)) is None:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
    return obj


async def _status(k8s: kmock.KubernetesEmulator, name: str = NAME) -> dict[str, Any]:
    return (await _get(k8s, f"{API}/{name}") or {}).get("status") or {}


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


async def _settings(http: httpx.AsyncClient, server: Server, token: str) -> dict[str, Any]:
    r = await http.get(
        server.url + "/admin/scheduler_config", headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_operator_applies_pushes_catches_up_and_refuses(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "profile.json", make_profile(fixed_s=0.005))

    async def scenario() -> None:
        async with (
            cluster(tmp_path) as k8s,
            contextlib.AsyncExitStack() as stack,
            httpx.AsyncClient(timeout=10) as http,
        ):
            await k8s.post(API, json=_resource(NAME, SPEC))

            # Every owned object, owned.
            paths = {
                "ConfigMap": f"/api/v1/namespaces/{NS}/configmaps/{NAME}-scheduler",
                "Service": f"/api/v1/namespaces/{NS}/services/{NAME}-server",
                "Deployment": f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}",
                "Router": f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-router",
                "RouterService": f"/api/v1/namespaces/{NS}/services/{NAME}-router",
                "ServiceAccount": f"/api/v1/namespaces/{NS}/serviceaccounts/{NAME}-router",
                "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/{NAME}-router",
                "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/"
                f"{NAME}-router",
                "PDB": f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{NAME}",
                "AdminSecret": f"/api/v1/namespaces/{NS}/secrets/{NAME}-admin",
                "KeySecret": f"/api/v1/namespaces/{NS}/secrets/{NAME}-api-key",
                "RouterTokenSecret": f"/api/v1/namespaces/{NS}/secrets/{NAME}-router-token",
            }
            objects = {k: await _wait_for(k8s, p, k) for k, p in paths.items()}
            for kind, obj in objects.items():
                (owner,) = obj["metadata"]["ownerReferences"]
                assert (owner["kind"], owner["uid"], owner["controller"]) == (
                    "LLMDeployment", f"uid-{NAME}", True
                ), kind  # fmt: skip
            deployment = objects["Deployment"]
            assert deployment["spec"]["replicas"] == 2
            template = copy.deepcopy(deployment["spec"]["template"])
            token = base64.b64decode(objects["AdminSecret"]["data"]["token"]).decode()
            desired = desired_settings(parse_spec(SPEC))
            desired_hash = settings_hash_of(desired)

            # Pod a starts from the ConfigMap, as the Deployment's pods do; pod b with the
            # server's defaults (as if it had missed every push).
            config = tmp_path / "scheduler.yaml"
            config.write_text(objects["ConfigMap"]["data"]["scheduler.yaml"])
            common = ("--simulate", str(profile), f"--admin-token={token}", *REPLICA_FLAGS)
            port_b = free_port()

            async def start(*flags: str, port: int | None = None) -> Server:
                cm = run_server(*common, *flags, port=port)
                return await asyncio.to_thread(stack.enter_context, cm)

            a = await start("--config", str(config))
            b = await start(port=port_b)
            load_a = (await http.get(a.url + "/load")).json()
            assert (load_a["config_hash"], load_a["config_version"]) == (desired_hash, 1)
            await k8s.post(f"/api/v1/namespaces/{NS}/pods", json=_pod("chat-a", a))
            await k8s.post(f"/api/v1/namespaces/{NS}/pods", json=_pod("chat-b", b))

            async def applied(version: int, spec: dict[str, Any]) -> bool:
                """Every pod runs ``spec``'s settings and the status says so (a pod's version
                is informational: b, at version 1 by default, took the first push as 2)."""
                status = await _status(k8s)
                if not (
                    _condition(status, "SchedulerConfigApplied").get("status") == "True"
                    and status.get("schedulerConfigVersion") == version
                    and set(status.get("podConfigVersions") or {}) == {"chat-a", "chat-b"}
                ):
                    return False
                want = settings_hash_of(desired_settings(parse_spec(spec)))
                for name, server in pods.items():
                    load = (await http.get(server.url + "/load")).json()
                    assert load["config_hash"] == want
                    assert load["config_version"] == status["podConfigVersions"][name]
                return True

            async def until_async(check: Any, what: str, timeout_s: float = 20) -> None:
                deadline = time.monotonic() + timeout_s
                while not await check():
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.05)

            # The timer catches b up (version 1, the settings of generation 1).
            pods = {"chat-a": a, "chat-b": b}
            await until_async(lambda: applied(1, SPEC), "b caught up")
            assert (await _settings(http, b, token))["max_num_seqs"] == 32

            # A live change reaches every ready pod, the ConfigMap, and the status.
            changed = {**SPEC, "scheduler": {**SPEC["scheduler"], "maxNumSeqs": 16}}
            start_s = time.monotonic()
            await k8s.patch(f"{API}/{NAME}", json={"metadata": {"generation": 2}, "spec": changed})
            await until_async(lambda: applied(2, changed), "generation 2 applied")
            elapsed = time.monotonic() - start_s
            print(f"live change: every ready pod applied it {elapsed:.2f} s after the patch")
            for server in (a, b):
                live = await _settings(http, server, token)
                assert live["max_num_seqs"] == 16 and live["config_version"] >= 2
                assert [t["name"] for t in live["tiers"]] == ["premium", "standard"]
            config_map = await _get(k8s, paths["ConfigMap"])
            file = yaml.safe_load(config_map["data"]["scheduler.yaml"])
            assert (file["max_num_seqs"], file["config_version"]) == (16, 2)
            deployment = await _get(k8s, paths["Deployment"])
            assert deployment["spec"]["template"] == template  # no roll for a live change
            status = await _status(k8s)
            assert _condition(status, "Ready")["status"] == "False"  # no Deployment controller
            assert status["observedGeneration"] == 2
            assert status["routerURL"] == f"http://{NAME}-router.{NS}.svc:8080"

            # b is down during the next push: a applies it, the condition says b is pending;
            # b, back on its port with its old settings, is caught up.
            stack_b = contextlib.ExitStack()
            b.proc.terminate()
            b.proc.wait(10)
            changed = {**changed, "scheduler": {**changed["scheduler"], "kvWatermark": 0.05}}
            await k8s.patch(f"{API}/{NAME}", json={"metadata": {"generation": 3}, "spec": changed})

            async def pending_b() -> bool:
                status = await _status(k8s)
                c = _condition(status, "SchedulerConfigApplied")
                return (
                    status.get("schedulerConfigVersion") == 3
                    and c.get("status") == "False"
                    and "chat-b" in c.get("message", "")
                )

            await until_async(pending_b, "b reported pending")
            c = _condition(await _status(k8s), "SchedulerConfigApplied")
            assert "chat-a" not in c["message"].split("(")[0], c
            assert (await _settings(http, a, token))["kv_watermark"] == 0.05
            b2 = await asyncio.to_thread(stack_b.enter_context, run_server(*common, port=port_b))
            pods["chat-b"] = b2
            try:
                await until_async(lambda: applied(3, changed), "b caught up after its restart")
                assert (await _settings(http, b2, token))["kv_watermark"] == 0.05
            finally:
                await asyncio.to_thread(stack_b.close)

            # An invalid spec: Ready=False with the reason, nothing applied.
            broken = {**changed, "scheduler": {**changed["scheduler"], "maxNumBatchedTokens": 8}}
            await k8s.patch(f"{API}/{NAME}", json={"metadata": {"generation": 4}, "spec": broken})

            async def invalid() -> bool:
                return _condition(await _status(k8s), "Ready").get("reason") == "InvalidSpec"

            await until_async(invalid, "invalid spec reported")
            message = _condition(await _status(k8s), "Ready")["message"]
            assert "maxNumBatchedTokens must be >= scheduler.maxNumSeqs" in message
            file = yaml.safe_load((await _get(k8s, paths["ConfigMap"]))["data"]["scheduler.yaml"])
            assert file["config_version"] == 3  # untouched
            assert (await _settings(http, a, token))["max_num_batched_tokens"] == 512

            # Autoscaling on: an HPA, and the Deployment's replicas left to it; off: the HPA
            # goes.
            hpa_path = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/{NAME}"
            scaled = {**changed, "autoscaling": {"enabled": True, "maxReplicas": 3}}
            await k8s.patch(f"{API}/{NAME}", json={"metadata": {"generation": 5}, "spec": scaled})
            await _wait_for(k8s, hpa_path, "the HPA")
            deployment = await _get(k8s, paths["Deployment"])
            assert deployment["spec"]["replicas"] == 2  # not reset: the HPA's now
            unscaled = {**changed, "autoscaling": {"enabled": False}}  # a merge patch
            await k8s.patch(f"{API}/{NAME}", json={"metadata": {"generation": 6}, "spec": unscaled})

            async def hpa_gone() -> bool:
                return await _get(k8s, hpa_path) is None

            await until_async(hpa_gone, "the HPA deleted")

            # A resource invalid from the start gets the condition and no objects.
            await k8s.post(API, json=_resource("bad", {**SPEC, "image": ""}))

            async def bad_reported() -> bool:
                return _condition(await _status(k8s, "bad"), "Ready").get("status") == "False"

            await until_async(bad_reported, "the bad resource's condition")
            assert await _get(k8s, f"/apis/apps/v1/namespaces/{NS}/deployments/bad") is None

            # Events for pushes, failed pushes and invalid specs (KMock keeps only the first
            # of those with the same name, so read what was posted).
            posted = [
                r.data for r in k8s.served if r.method == "POST" and r.url.path.endswith("/events")
            ]
            reasons = {e.get("reason") for e in posted}
            assert {"ConfigPushed", "ConfigPushFailed", "InvalidSpec"} <= reasons, reasons

            # Deletion runs cleanly: kopf's finalizer is removed and the resource goes.
            await k8s.delete(f"{API}/{NAME}")

            async def gone() -> bool:
                return await _get(k8s, f"{API}/{NAME}") is None

            # kopf first stops the resync timer (its pass in flight ends first): seconds.
            await until_async(gone, "the resource deleted", timeout_s=60)

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_many_odd_pods_and_owned_objects_changed_by_hand(tmp_path: Path) -> None:
    """30 pods on one simulated replica all get the settings; a pod refusing the admin token
    (another replica's), a pod nothing listens for, a pod without the port ``http`` and a
    terminating pod cost the others nothing; an owned object deleted by hand comes back and
    one edited by hand is corrected, by the timer."""
    profile = write_profile(tmp_path / "profile.json", make_profile(fixed_s=0.005))
    pods_api = f"/api/v1/namespaces/{NS}/pods"

    async def scenario() -> None:
        async with (
            cluster(tmp_path) as k8s,
            contextlib.AsyncExitStack() as stack,
            httpx.AsyncClient(timeout=10) as http,
        ):
            await k8s.post(API, json=_resource(NAME, SPEC))
            secret = await _wait_for(k8s, f"/api/v1/namespaces/{NS}/secrets/{NAME}-admin", "token")
            token = base64.b64decode(secret["data"]["token"]).decode()
            common = ("--simulate", str(profile), *REPLICA_FLAGS)

            async def start(*flags: str) -> Server:
                cm = run_server(*common, *flags)
                return await asyncio.to_thread(stack.enter_context, cm)

            replica, stranger = await asyncio.gather(
                start(f"--admin-token={token}"), start("--admin-token", "not-the-operators")
            )
            many = [f"chat-p{i}" for i in range(30)]
            for name in many:
                await k8s.post(pods_api, json=_pod(name, replica))
            await k8s.post(pods_api, json=_pod("chat-401", stranger))
            down = _pod("chat-down", replica)
            down["spec"]["containers"][0]["ports"][0]["containerPort"] = free_port()
            await k8s.post(pods_api, json=down)
            no_port = _pod("chat-noport", stranger)
            no_port["spec"]["containers"][0]["ports"][0]["name"] = "metrics"
            await k8s.post(pods_api, json=no_port)
            dying = _pod("chat-dying", stranger)
            dying["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            await k8s.post(pods_api, json=dying)
            want = settings_hash_of(desired_settings(parse_spec(SPEC)))

            deadline = time.monotonic() + 40
            while True:
                status = await _status(k8s)
                versions = status.get("podConfigVersions") or {}
                c = _condition(status, "SchedulerConfigApplied")
                # A pass that listed every pod: the pods are created one by one, and a pass
                # in between reports chat-401 before chat-down exists.
                message = c.get("message", "")
                if set(many) <= set(versions) and all(
                    p in message for p in ("chat-401", "chat-down")
                ):
                    break
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.05)
            assert c["status"] == "False"
            pending = c["message"].split(" (")[0]
            assert set(pending.split(": ")[1].split(", ")) == {"chat-401", "chat-down"}, c
            assert "chat-401: 401" in c["message"]
            assert not {"chat-noport", "chat-dying"} & set(versions)
            assert (await http.get(replica.url + "/load")).json()["config_hash"] == want
            assert (await http.get(stranger.url + "/load")).json()["config_hash"] != want

            # By hand: the ConfigMap deleted, the router Service's port and the server
            # Deployment's image changed.
            config_map = f"/api/v1/namespaces/{NS}/configmaps/{NAME}-scheduler"
            deployment = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
            service = f"/api/v1/namespaces/{NS}/services/{NAME}-router"
            original = await _get(k8s, config_map)
            await k8s.delete(config_map)
            await k8s.patch(deployment, json={"spec": {"template": {"spec": {"containers": [
                {"name": "server", "image": "evil:1"}]}}}})  # fmt: skip
            await k8s.patch(service, json={"spec": {"ports": [{"name": "http", "port": 1}]}})

            async def corrected() -> bool:
                cm, d, svc = [await _get(k8s, p) for p in (config_map, deployment, service)]
                return (
                    cm is not None
                    and cm["data"] == original["data"]
                    and d["spec"]["template"]["spec"]["containers"][0]["image"] == SPEC["image"]
                    and svc["spec"]["ports"][0]["port"] == 8080
                )

            deadline = time.monotonic() + 30
            while not await corrected():
                assert time.monotonic() < deadline, "owned objects not corrected"
                await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(scenario(), timeout=90))


@pytest.fixture(autouse=True)
def _quiet_kopf() -> None:
    kopf.configure(verbose=False)
