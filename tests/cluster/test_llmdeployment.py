"""An LLMDeployment's life on a real API server, as a user drives it with kubectl: the chart's
operator (cluster-wide, as its ServiceAccount) creates the server and router Deployments, the
Deployment and ReplicaSet controllers make pods, kube-scheduler places them on the fake GPU
nodes, the pod runner starts simulated replicas, the endpointslice controller writes the
router's EndpointSlices; live patches, scaling, invalid patches and deletion."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from cluster_utils import (
    NAME,
    LocalCluster,
    admin_url,
    condition,
    live_settings,
    manifest,
    patch_spec,
    pod_url,
    ready_pods,
    secret,
    server_pods,
    wait_until,
)


@pytest.fixture(scope="module")
def deployed(cluster: LocalCluster, operator_release: str) -> Iterator[str]:
    """``kubectl apply -f`` of an LLMDeployment with 2 replicas of 4 GPUs, Ready; its
    namespace."""
    namespace = cluster.namespace("serving")
    cluster.kubectl("apply", "-f", "-", input=manifest(namespace))

    def ready() -> dict[str, Any] | None:
        llmd = cluster.get("llmd", NAME, namespace)
        status = (llmd or {}).get("status") or {}
        if (
            status.get("readyReplicas") == 2
            and condition(llmd, "SchedulerConfigApplied")["status"] == "True"
        ):
            return llmd
        return None

    wait_until(ready, "READY 2/2 with the settings applied", timeout_s=90)
    yield namespace
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")  # its GPUs back


def test_apply_makes_scheduled_running_ready_replicas(cluster: LocalCluster, deployed: str) -> None:
    llmd = cluster.get("llmd", NAME, deployed)
    generation = llmd["metadata"]["generation"]
    assert llmd["status"]["observedGeneration"] == generation
    for kind in ("Ready", "Progressing", "SchedulerConfigApplied"):
        assert condition(llmd, kind)["observedGeneration"] == generation
    assert condition(llmd, "Ready")["status"] == "True"
    assert condition(llmd, "Progressing")["reason"] == "Complete"
    # kubectl get llmd: the printer columns.
    table = cluster.kubectl("get", "llmd", "-n", deployed)
    assert re.search(rf"^{NAME}\s+llama-3-70b\s+2\s+2\s+1\s+True\s", table, re.M), table
    # The API server defaulted the spec (the CRD's defaults, spelled out).
    assert llmd["spec"]["scheduler"]["maxNumSeqs"] == 128
    assert llmd["spec"]["autoscaling"]["enabled"] is False

    pods = server_pods(cluster, deployed)
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] in ("gpu-node-0", "gpu-node-1")  # kube-scheduler's
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert pod["status"]["phase"] == "Running"
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "ReplicaSet"  # Deployment -> ReplicaSet -> pod
    # Owned objects carry the LLMDeployment's uid (blockOwnerDeletion: allowed by the chart's
    # finalizers permission under OwnerReferencesPermissionEnforcement).
    deployment = cluster.get("deployment", NAME, deployed)
    (reference,) = deployment["metadata"]["ownerReferences"]
    assert reference["uid"] == llmd["metadata"]["uid"] and reference["blockOwnerDeletion"]


def test_router_pod_follows_the_clusters_endpointslices(
    cluster: LocalCluster, deployed: str
) -> None:
    """Requests to the router pod's IP stream from both replicas, which the router found in
    the EndpointSlices the endpointslice controller wrote."""
    slices = cluster.get("endpointslices", namespace=deployed)
    server_slices = [
        s
        for s in slices
        if s["metadata"]["labels"]["kubernetes.io/service-name"] == f"{NAME}-server"
    ]
    addresses = {a for s in server_slices for e in s["endpoints"] for a in e["addresses"]}
    assert addresses == {p["status"]["podIP"] for p in server_pods(cluster, deployed)}
    (router,) = [
        p
        for p in cluster.get("pods", namespace=deployed)
        if p["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    ]
    router_url = f"http://{router['status']['podIP']}:8080"
    api_key = secret(cluster, deployed, f"{NAME}-api-key", "api-key")
    wait_until(
        lambda: httpx.get(f"{router_url}/load", timeout=5).json()["num_ready_replicas"] == 2,
        "the router to see both replicas",
    )

    def stream(i: int) -> list[str]:
        body = {
            "model": "llama-3-70b",
            "prompt": f"request {i} " * 8,
            "max_tokens": 48,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {api_key}"}
        with httpx.stream(
            "POST", f"{router_url}/v1/completions", json=body, headers=headers, timeout=30
        ) as response:
            assert response.status_code == 200, response.read()
            return [line for line in response.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(stream, range(8)))
    for events in streams:
        assert events[-1] == "data: [DONE]"
        assert len(events) > 2
    metrics = httpx.get(f"{router_url}/metrics", timeout=5).text
    served = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'iterserve_router_requests_total\{code="200",replica="([^"]+)"\} (\S+)', metrics
        )
    }
    # Labelled by pod name (the EndpointSlice's targetRef), not URL: no series per pod IP.
    assert {name for name, n in served.items() if n > 0} == {
        p["metadata"]["name"] for p in server_pods(cluster, deployed)
    }, served


def test_patch_reaches_every_replica_live_and_invalid_patches_are_refused(
    cluster: LocalCluster, deployed: str
) -> None:
    pods_before = {p["metadata"]["name"]: p for p in server_pods(cluster, deployed)}
    admin_token = secret(cluster, deployed, f"{NAME}-admin", "token")
    started = time.monotonic()
    cluster.kubectl(
        "patch",
        "llmd",
        NAME,
        "-n",
        deployed,
        "--type",
        "merge",
        "-p",
        '{"spec": {"scheduler": {"maxNumSeqs": 48, "chunkSize": 256}}}',
    )

    def applied() -> bool:
        return all(
            (s := live_settings(p, admin_token))["max_num_seqs"] == 48
            and s["long_prefill_token_threshold"] == 256
            for p in pods_before.values()
        )

    wait_until(applied, "every replica at the new settings", timeout_s=5, period_s=0.1)
    assert time.monotonic() - started < 5.5
    llmd = wait_until(
        lambda: (
            (o := cluster.get("llmd", NAME, deployed))["status"]["observedGeneration"]
            == o["metadata"]["generation"]
            and o
        ),
        "the status to catch up",
    )
    version = llmd["metadata"]["generation"]
    assert llmd["status"]["schedulerConfigVersion"] == version
    assert llmd["status"]["podConfigVersions"] == {name: version for name in pods_before}
    assert condition(llmd, "SchedulerConfigApplied")["status"] == "True"
    # No restart: the same pods, their containers never restarted.
    after = {p["metadata"]["name"]: p for p in server_pods(cluster, deployed)}
    assert after.keys() == pods_before.keys()
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in after.values())

    # Refused by the API server itself (CEL and OpenAPI), with the message kubectl prints.
    refused = patch_spec(cluster, deployed, {"scheduler": {"maxNumBatchedTokens": 16}})
    assert refused.returncode != 0
    assert "scheduler.maxNumBatchedTokens must be >= scheduler.maxNumSeqs" in refused.stderr
    negative = patch_spec(cluster, deployed, {"scheduler": {"maxNumSeqs": -1}})
    assert negative.returncode != 0
    assert "spec.scheduler.maxNumSeqs" in negative.stderr and "greater than or equal to 1" in (
        negative.stderr
    )
    unchanged = cluster.get("llmd", NAME, deployed)
    assert unchanged["metadata"]["generation"] == version
    assert all(live_settings(p, admin_token)["max_num_seqs"] == 48 for p in after.values())


def test_admin_token_rotation_with_a_live_change_in_the_same_pass(
    cluster: LocalCluster, deployed: str
) -> None:
    """The admin API answers on the pods' admin port only, and the API server took the
    NetworkPolicies guarding it. One ``kubectl patch`` annotates a rotation and changes a
    setting: the operator writes NEW\nOLD into N-admin and pushes in the same pass, while
    every pod's file still holds OLD alone (the pod runner refreshes volumes every 2 s, as a
    kubelet does every minute): the push falls back to OLD and applies; once the files are
    swapped the pods take NEW."""
    pods = server_pods(cluster, deployed)
    (old,) = secret(cluster, deployed, f"{NAME}-admin", "token").split()
    bearer = {"Authorization": f"Bearer {old}"}
    hidden = httpx.get(f"{pod_url(pods[0])}/admin/scheduler_config", headers=bearer, timeout=5)
    assert hidden.status_code == 404
    policy = cluster.get("networkpolicy", f"{NAME}-server", deployed)
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == [8000, 8001, 5557]
    body = {"metadata": {"annotations": {"iterserve.io/rotate-admin-token": "r1"}},
            "spec": {"scheduler": {"maxNumSeqs": 40}}}  # fmt: skip
    cluster.kubectl("patch", "llmd", NAME, "-n", deployed, "--type", "merge", "-p",
                    json.dumps(body))  # fmt: skip

    def applied() -> bool:
        return all(httpx.get(f"{pod_url(p)}/load", timeout=5).json()["max_num_seqs"] == 40
                   for p in pods)  # fmt: skip

    wait_until(applied, "the change applied on every pod", timeout_s=20, period_s=0.1)
    new, previous = secret(cluster, deployed, f"{NAME}-admin", "token").split()
    assert previous == old and new != old
    llmd = wait_until(
        lambda: (
            (o := cluster.get("llmd", NAME, deployed))["status"].get("adminTokenRotation") == "r1"
            and o
        ),
        "the rotation in the status",
    )
    assert condition(llmd, "SchedulerConfigApplied")["status"] == "True"

    def new_token_accepted() -> bool:
        headers = {"Authorization": f"Bearer {new}"}
        return all(
            httpx.get(f"{admin_url(p)}/admin/scheduler_config", headers=headers, timeout=5)
            .status_code == 200
            for p in pods
        )  # fmt: skip

    wait_until(new_token_accepted, "the pods to accept the new token", timeout_s=20)


def test_scale_subresource_and_gpu_capacity(cluster: LocalCluster, deployed: str) -> None:
    """``kubectl scale llmd``: 3 replicas fit the two 8-GPU nodes beside the first two
    (4 x 4 GPUs = 16); a 5th stays Pending and the status says why."""
    cluster.kubectl("scale", "llmd", NAME, "-n", deployed, "--replicas", "5")
    wait_until(lambda: len(server_pods(cluster, deployed)) == 5, "5 server pods")

    def unschedulable() -> dict[str, Any] | None:
        llmd = cluster.get("llmd", NAME, deployed)
        progressing = condition(llmd, "Progressing")
        return llmd if progressing["reason"] == "Unschedulable" else None

    llmd = wait_until(unschedulable, "Progressing=Unschedulable in the status")
    assert "Insufficient nvidia.com/gpu" in condition(llmd, "Progressing")["message"]
    pods = server_pods(cluster, deployed)
    pending = [p for p in pods if p["status"].get("phase") == "Pending"]
    assert len(pending) == 1 and not pending[0]["spec"].get("nodeName")
    wait_until(lambda: len(ready_pods(server_pods(cluster, deployed))) == 4, "4 ready replicas")
    # Back to 2: the scale subresource again, the status follows.
    cluster.kubectl("scale", "llmd", NAME, "-n", deployed, "--replicas", "2")
    wait_until(
        lambda: (
            condition(o := cluster.get("llmd", NAME, deployed), "Progressing")["reason"]
            == "Complete"
            and o["status"]["readyReplicas"] == 2
        ),
        "back to 2 ready replicas",
    )
    assert (
        cluster.kubectl("get", "llmd", NAME, "-n", deployed, "-o", "jsonpath={.status.replicas}")
        == "2"
    )


def test_delete_collects_every_owned_object(cluster: LocalCluster, operator_release: str) -> None:
    """``kubectl delete llmd``: the garbage collector removes what the operator created, the
    finalizer goes, nothing is orphaned."""
    namespace = cluster.namespace("gc")
    cluster.kubectl("apply", "-f", "-", input=manifest(namespace, replicas=1, gpus=0))
    wait_until(
        lambda: (
            (cluster.get("llmd", NAME, namespace).get("status") or {}).get("readyReplicas") == 1
        ),
        "one ready replica",
        timeout_s=90,
    )
    uid = cluster.get("llmd", NAME, namespace)["metadata"]["uid"]
    kinds = (
        "deployments,replicasets,pods,services,configmaps,secrets,serviceaccounts,roles,"
        "rolebindings,poddisruptionbudgets"
    )

    def owned() -> list[str]:
        found = []
        for obj in cluster.get(kinds, namespace=namespace):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r["uid"] == uid for r in refs) or obj["kind"] in ("ReplicaSet", "Pod"):
                found.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return found

    before = owned()
    assert {
        "Deployment/chat",
        "Deployment/chat-router",
        "ConfigMap/chat-scheduler",
        "Secret/chat-admin",
        "Secret/chat-api-key",
        "Secret/chat-router-token",
        "Service/chat-server",
    } <= set(before)
    cluster.kubectl("delete", "llmd", NAME, "-n", namespace, "--wait=true", "--timeout=60s")
    assert cluster.get("llmd", NAME, namespace) is None  # the finalizer was removed
    wait_until(
        lambda: owned() == [], "the garbage collector to remove every owned object", timeout_s=60
    )


def test_the_api_server_refuses_what_the_crd_rules_forbid(
    cluster: LocalCluster, operator_release: str
) -> None:
    """A tensor-parallel degree the GPUs do not divide by: refused at ``kubectl apply`` by
    the CRD's CEL rule, so nothing exists for the operator to act on."""
    namespace = cluster.namespace("invalid")
    refused = cluster.run(
        "kubectl",
        "apply",
        "-f",
        "-",
        check=False,
        input=manifest(namespace, gpus=4, tensorParallelSize=3),
    )
    assert refused.returncode != 0
    assert "tensorParallelSize must divide resources.gpus" in refused.stderr
    assert cluster.get("llmd", NAME, namespace) is None
