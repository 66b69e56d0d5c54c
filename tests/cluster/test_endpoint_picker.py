"""``spec.router.mode: endpointPicker`` on a real API server: before the Gateway API Inference
Extension's CRD is installed the operator runs the picker and says why nothing routes yet
(``Ready=False``, ``InferencePoolMissing``); once it is (our InferencePool CRD, written from
GAIE's published v1 API: tools/k8s/crds), the API server accepts the InferencePool the operator
writes, and an HTTPRoute (Gateway API's own standard CRDs, from its Go module:
scripts/gateway-api-crds) whose backendRef is the pool; the pool selects exactly the server
pods, and with ``router.kvEvents`` a server pod publishes its KV-cache events on its
``kv-events`` port, its pod's name in the topic. Back in proxy mode the picker's objects go
and two router replicas run behind their PodDisruptionBudget."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import httpx
import zmq
from cluster_utils import (
    NAME,
    LocalCluster,
    condition,
    manifest,
    patch_spec,
    pod_url,
    ready_pods,
    secret,
    server_pods,
    wait_until,
)
from k8s_tools import REPO

from iterserve.kv_events import BlockStored, decode_message

POOL_CRD = REPO / "tools" / "k8s" / "crds" / "inferencepools.inference.networking.k8s.io.yaml"


def gateway_api_crds() -> str:
    """The directory of Gateway API's standard CRDs (fetched and cached by the script)."""
    result = subprocess.run(
        [str(REPO / "scripts" / "gateway-api-crds")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def install_crds(cluster: LocalCluster) -> None:
    # Server-side: HTTPRoute's CRD is larger than client-side apply's annotation may hold.
    cluster.kubectl("apply", "--server-side", "-f", str(POOL_CRD), "-f", gateway_api_crds())
    for resource in ("inferencepools.inference.networking.k8s.io", "httproutes"):
        wait_until(
            lambda r=resource: cluster.run("kubectl", "get", r, "-A", check=False).returncode == 0,
            f"{resource} served",
        )


def ready_reason(cluster: LocalCluster, namespace: str) -> str | None:
    llmd = cluster.get("llmd", NAME, namespace) or {}
    conditions = (llmd.get("status") or {}).get("conditions") or []
    return next((c["reason"] for c in conditions if c["type"] == "Ready"), None)


def http_route(namespace: str) -> str:
    return json.dumps({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm", "namespace": namespace},
        "spec": {
            "parentRefs": [{"name": "inference-gateway"}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io",
                                 "kind": "InferencePool", "name": NAME}],
            }],
        },
    })  # fmt: skip


def check_pool(cluster: LocalCluster, namespace: str) -> None:
    """The pool as the API server stored it (defaults filled in) selects the server pods."""
    pool: dict[str, Any] = cluster.get("inferencepool", NAME, namespace)
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "LLMDeployment"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref == {"group": "", "kind": "Service", "name": f"{NAME}-epp",
                   "port": {"number": 9002}, "failureMode": "FailClose"}  # fmt: skip
    service = cluster.get("service", f"{NAME}-epp", namespace)
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert (grpc["port"], grpc["appProtocol"]) == (9002, "kubernetes.io/h2c")
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    selected = cluster.get("pods", namespace=namespace) or []
    by_pool = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector,
                                         "-o", "json"))["items"]  # fmt: skip
    servers = [p for p in selected if p["metadata"]["labels"]["app.kubernetes.io/component"]
               == "server"]  # fmt: skip
    assert servers and {p["metadata"]["name"] for p in by_pool} == {
        p["metadata"]["name"] for p in servers
    }
    for pod in by_pool:
        (http,) = [p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http"]
        assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]


def ready_count(cluster: LocalCluster, deployment: str, namespace: str) -> int | None:
    live = cluster.get("deployment", deployment, namespace) or {}
    ready: int | None = (live.get("status") or {}).get("readyReplicas")
    return ready


def kv_pickers_ready(cluster: LocalCluster, namespace: str) -> int:
    """Ready picker pods started with ``--kv-events-port``, none of the old ones left."""
    pods = [p for p in cluster.get("pods", namespace=namespace) or []
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "epp"
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
    if any("--kv-events-port" not in p["spec"]["containers"][0]["args"] for p in pods):
        return 0
    return len(ready_pods(pods))


def publishing(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    """The ready server pods with a ``kv-events`` port."""
    return [
        pod
        for pod in ready_pods(server_pods(cluster, namespace))
        if any(p["name"] == "kv-events" for p in pod["spec"]["containers"][0]["ports"])
    ]


def check_kv_events(cluster: LocalCluster, namespace: str) -> None:
    """A server pod publishes on its port 5557 with its pod's name in
    the topic: a completion sent to it directly shows up as BlockStored events."""
    (pod, *_) = publishing(cluster, namespace)
    (port,) = [p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "kv-events"]
    key = secret(cluster, namespace, f"{NAME}-api-key", "api-key")
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    try:
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(f"tcp://{pod['status']['podIP']}:{port['containerPort']}")
        deadline, stored = time.monotonic() + 30, []
        while not stored and time.monotonic() < deadline:
            # A subscription takes a moment to reach the publisher: a new prompt each round.
            prompt = f"{time.monotonic()} " + "a shared system prompt, long enough. " * 8
            body = {"model": "llama-3-70b", "prompt": prompt, "max_tokens": 2}
            headers = {"Authorization": f"Bearer {key}"}
            answer = httpx.post(pod_url(pod) + "/v1/completions", json=body, headers=headers,
                                timeout=30)  # fmt: skip
            assert answer.status_code == 200, answer.text
            while subscriber.poll(500):
                message = decode_message(subscriber.recv_multipart())
                assert message.topic == f"kv@{pod['metadata']['name']}@llama-3-70b"
                stored += [e for e in message.batch.events if isinstance(e, BlockStored)]
        assert stored and stored[0].token_ids, "no BlockStored event from the server pod"
    finally:
        subscriber.close(linger=0)
        context.term()


def test_endpoint_picker_mode_then_back_to_two_routers(
    cluster: LocalCluster, operator_release: str
) -> None:
    namespace = cluster.namespace("epp")
    assert cluster.run("kubectl", "get", "crd", POOL_CRD.stem, check=False).returncode != 0
    router = {"mode": "endpointPicker", "replicas": 2}
    # The gateway would run in this namespace: its pods may reach the servers and the picker.
    body = manifest(namespace, replicas=1, gpus=0, router=router,
                    networkPolicy={"apiFrom": [namespace]})  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=body)
    wait_until(lambda: ready_reason(cluster, namespace) == "InferencePoolMissing",
               "Ready=False: InferencePoolMissing")  # fmt: skip
    picker = cluster.get("deployment", f"{NAME}-epp", namespace)
    assert picker["spec"]["replicas"] == 2
    assert picker["spec"]["template"]["spec"]["containers"][0]["args"][:3] == [
        "router", "--mode", "endpoint-picker"]  # fmt: skip
    assert cluster.get("pdb", f"{NAME}-epp", namespace) is not None
    assert cluster.get("deployment", f"{NAME}-router", namespace) is None
    llmd = cluster.get("llmd", NAME, namespace)
    assert llmd["status"]["inferencePool"] == NAME and "routerURL" not in llmd["status"]
    events = cluster.kubectl("get", "events", "-n", namespace,
                             "--field-selector", "reason=InferencePoolMissing")  # fmt: skip
    assert "install the Gateway API Inference Extension" in events

    install_crds(cluster)
    wait_until(lambda: cluster.get("inferencepool", NAME, namespace), "the operator's pool",
               timeout_s=30)  # fmt: skip
    wait_until(lambda: condition(cluster.get("llmd", NAME, namespace), "Ready")["status"]
               == "True", "Ready once a server pod is", timeout_s=90)  # fmt: skip
    check_pool(cluster, namespace)
    cluster.kubectl("apply", "-f", "-", input=http_route(namespace))
    route = cluster.get("httproute", "llm", namespace)
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    # The pickers run (iterserve router --mode endpoint-picker as the operator starts it) and
    # are ready: their /ready says they found a ready server pod through the EndpointSlices
    # their ServiceAccount may read.
    wait_until(lambda: ready_count(cluster, f"{NAME}-epp", namespace) == 2,
               "two pickers ready", timeout_s=90)  # fmt: skip

    # The server pods publish (always, on 5557); KV events on: the pickers subscribe.
    assert patch_spec(cluster, namespace, {"router": {"kvEvents": True}}).returncode == 0
    wait_until(lambda: publishing(cluster, namespace), "a ready server pod publishing",
               timeout_s=90)  # fmt: skip
    check_kv_events(cluster, namespace)
    # The pickers roll too (--kv-events-port 5557 --tokenizer on the model's volume, which the
    # pod runner maps to the simulated replicas' tokenizer) and are ready again.
    wait_until(lambda: kv_pickers_ready(cluster, namespace) == 2, "two KV-event pickers ready",
               timeout_s=90)  # fmt: skip

    # Back to proxy mode: the picker's objects deleted, two routers Ready behind their budget.
    assert (
        patch_spec(cluster, namespace, {"router": {"mode": "proxy", "kvEvents": False}}).returncode
        == 0
    )
    wait_until(lambda: cluster.get("inferencepool", NAME, namespace) is None, "the pool deleted")
    for kind in ("deployment", "service", "pdb", "networkpolicy"):
        wait_until(lambda k=kind: cluster.get(k, f"{NAME}-epp", namespace) is None,
                   f"{kind} {NAME}-epp deleted")  # fmt: skip
    pdb = wait_until(lambda: cluster.get("pdb", f"{NAME}-router", namespace), "the router's PDB")
    assert pdb["spec"]["maxUnavailable"] == 1
    wait_until(lambda: ready_count(cluster, f"{NAME}-router", namespace) == 2,
               "two router replicas ready", timeout_s=90)  # fmt: skip
    wait_until(lambda: (cluster.get("pdb", f"{NAME}-router", namespace).get("status") or {}).get(
        "disruptionsAllowed") == 1, "the disruption controller allowing one eviction")  # fmt: skip
    llmd = cluster.get("llmd", NAME, namespace)
    assert llmd["status"]["routerURL"] == f"http://{NAME}-router.{namespace}.svc:8080"
    assert "inferencePool" not in llmd["status"]
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
