"""Faults on a real control plane: a replica process killed, the operator killed in the middle
of a change, the API server and etcd killed together. Each ends with the deployment at the
spec's settings, with no help from the test beyond the kill."""

from __future__ import annotations

import os
import signal
from typing import Any

import httpx
import pytest
from cluster_utils import (
    NAME,
    LocalCluster,
    component_pid,
    condition,
    live_settings,
    manifest,
    patch_spec,
    pod_pid,
    ready_pods,
    secret,
    server_pods,
    wait_until,
)


def _deploy(cluster: LocalCluster, prefix: str, replicas: int = 1) -> str:
    """An LLMDeployment of CPU replicas (gpus 0), READY; its namespace."""
    namespace = cluster.namespace(prefix)
    cluster.kubectl("apply", "-f", "-", input=manifest(namespace, replicas=replicas, gpus=0))
    wait_until(
        lambda: (
            (cluster.get("llmd", NAME, namespace).get("status") or {}).get("readyReplicas")
            == replicas
        ),
        f"{replicas} ready replicas",
        timeout_s=90,
    )
    return namespace


def _converged(cluster: LocalCluster, namespace: str, max_num_seqs: int, replicas: int) -> bool:
    """Every ready replica at ``max_num_seqs``, as many as asked, and the status says so."""
    llmd = cluster.get("llmd", NAME, namespace)
    status = llmd.get("status") or {}
    pods = ready_pods(server_pods(cluster, namespace))
    token = secret(cluster, namespace, f"{NAME}-admin", "token")
    return (
        len(pods) == replicas
        and all(live_settings(p, token)["max_num_seqs"] == max_num_seqs for p in pods)
        and status.get("observedGeneration") == llmd["metadata"]["generation"]
        and condition(llmd, "SchedulerConfigApplied")["status"] == "True"
        and status.get("readyReplicas") == replicas
    )


@pytest.fixture
def operator_pod(cluster: LocalCluster, operator_release: str) -> dict[str, Any]:
    (pod,) = ready_pods(cluster.get("pods", namespace=operator_release))
    return dict(pod)


def test_a_killed_replica_restarts_and_catches_up(
    cluster: LocalCluster, operator_release: str
) -> None:
    namespace = _deploy(cluster, "replica-kill")
    assert patch_spec(cluster, namespace, {"scheduler": {"maxNumSeqs": 24}}).returncode == 0
    wait_until(lambda: _converged(cluster, namespace, 24, 1), "the live change applied")
    (pod,) = server_pods(cluster, namespace)
    os.kill(pod_pid(cluster, namespace, pod["metadata"]["name"]), signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        (now,) = server_pods(cluster, namespace)
        status = now["status"]["containerStatuses"][0]
        return now if status["restartCount"] == 1 and status["ready"] else None

    after = wait_until(restarted, "the container restarted and Ready again", timeout_s=60)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]  # restarted in place
    token = secret(cluster, namespace, f"{NAME}-admin", "token")
    assert live_settings(after, token)["max_num_seqs"] == 24  # from the ConfigMap
    wait_until(lambda: _converged(cluster, namespace, 24, 1), "the status after the restart")


def test_the_operator_killed_mid_change_resumes_and_converges(
    cluster: LocalCluster, operator_release: str, operator_pod: dict[str, Any]
) -> None:
    namespace = _deploy(cluster, "operator-kill")
    name = operator_pod["metadata"]["name"]
    restarts = operator_pod["status"]["containerStatuses"][0]["restartCount"]
    assert (
        patch_spec(cluster, namespace, {"replicas": 2, "scheduler": {"maxNumSeqs": 40}}).returncode
        == 0
    )
    os.kill(pod_pid(cluster, operator_release, name), signal.SIGKILL)
    wait_until(
        lambda: (
            ready_pods(cluster.get("pods", namespace=operator_release))[0]["status"][
                "containerStatuses"
            ][0]["restartCount"]
            == restarts + 1
        ),
        "the operator restarted",
        timeout_s=60,
    )
    # The dead operator's peering record pauses its successor until it expires: at most
    # the operator's peering lifetime (15 s; kopf's default 60 s held changes ~55 s here).
    wait_until(
        lambda: _converged(cluster, namespace, 40, 2),
        "both replicas at the new settings after the operator's restart",
        timeout_s=40,
    )


def test_api_server_and_etcd_killed_watches_recover(
    cluster: LocalCluster, operator_release: str
) -> None:
    """Both killed at once (the cluster starts them again, etcd first): afterwards the
    operator still sees changes (its watch came back) and the router follows a new replica
    (its EndpointSlice watch came back)."""
    namespace = _deploy(cluster, "apiserver-kill")
    (router,) = [
        p
        for p in cluster.get("pods", namespace=namespace)
        if p["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    ]
    router_url = f"http://{router['status']['podIP']}:8080"
    for component in ("kube-apiserver", "etcd"):
        os.kill(component_pid(cluster, component), signal.SIGKILL)
    wait_until(
        lambda: cluster.run("kubectl", "get", "--raw", "/readyz", check=False).stdout == "ok",
        "the API server back",
        timeout_s=60,
    )
    assert (
        patch_spec(cluster, namespace, {"replicas": 2, "scheduler": {"maxNumSeqs": 20}}).returncode
        == 0
    )
    wait_until(lambda: _converged(cluster, namespace, 20, 2), "the change applied", timeout_s=90)
    wait_until(
        lambda: httpx.get(f"{router_url}/load", timeout=5).json()["num_ready_replicas"] == 2,
        "the router to see the new replica",
        timeout_s=60,
    )


def test_a_pod_waiting_for_its_secret_starts_once_it_exists(
    cluster: LocalCluster, operator_release: str
) -> None:
    """``spec.pod.env`` naming a key its Secret lacks: the pod waits
    (CreateContainerConfigError, as a kubelet reports it) while every other pod runs, and
    starts once the key exists; an ``optional`` reference to a missing Secret is left out."""
    namespace = cluster.namespace("late-secret")
    cluster.kubectl("create", "secret", "generic", "late", "-n", namespace,
                    "--from-literal=other=1")  # fmt: skip
    env = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "token"}}},
        {"name": "EXTRA", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "x",
                                                         "optional": True}}},
    ]  # fmt: skip
    body = manifest(namespace, replicas=1, gpus=0, pod={"env": env})
    cluster.kubectl("apply", "-f", "-", input=body)

    def waiting() -> dict[str, Any] | None:
        pods = server_pods(cluster, namespace)
        statuses = pods[0]["status"].get("containerStatuses") if pods else None
        return (statuses or [{}])[0].get("state", {}).get("waiting")

    state = wait_until(waiting, "the pod to wait")
    assert state["reason"] == "CreateContainerConfigError"
    assert "couldn't find key token in secret" in state["message"]
    # The runner goes on with every other pod: the router of the same deployment runs (not
    # Ready: a router is ready once a replica is).
    wait_until(
        lambda: any(
            p["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
            and p["status"].get("phase") == "Running"
            and p["status"]["containerStatuses"][0]["state"].get("running")
            for p in cluster.get("pods", namespace=namespace)
        ),
        "the router running while the server waits",
    )
    cluster.kubectl("patch", "secret", "late", "-n", namespace, "-p",
                    '{"stringData": {"token": "t0ken"}}')  # fmt: skip
    wait_until(lambda: len(ready_pods(server_pods(cluster, namespace))) == 1, "the pod Ready")
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
