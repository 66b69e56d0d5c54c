"""Autoscaling on a real control plane: the operator's HPA, driven by the real HPA controller
through a custom-metrics API (a fake adapter the test runs), scales the server Deployment and
the operator leaves the replica count to it; KEDA's ScaledObject (KEDA's own CRD installed)
passes the API server's validation and replaces the HPA."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_utils import NAME, LocalCluster, manifest, ready_pods, server_pods, wait_until
from metrics_adapter import MetricsAdapter


@pytest.fixture
def adapter(cluster: LocalCluster, tmp_path: Path) -> Iterator[MetricsAdapter]:
    fake = MetricsAdapter(cluster, tmp_path)
    fake.register()
    wait_until(
        lambda: cluster.run("kubectl", "get", "--raw", "/apis/custom.metrics.k8s.io/v1beta2",
                            check=False).returncode == 0,
        "the custom metrics API served through the aggregator",
    )  # fmt: skip
    yield fake
    fake.close()


def test_hpa_scales_on_queue_depth_and_keda_replaces_it(
    cluster: LocalCluster, operator_release: str, adapter: MetricsAdapter
) -> None:
    namespace = cluster.namespace("autoscale")
    autoscaling = {"enabled": True, "via": "hpa", "minReplicas": 1, "maxReplicas": 3,
                   "targetQueueDepth": 8}  # fmt: skip
    body = manifest(namespace, replicas=1, gpus=0, autoscaling=autoscaling)
    cluster.kubectl("apply", "-f", "-", input=body)
    hpa = wait_until(lambda: cluster.get("hpa", NAME, namespace), "the operator's HPA")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": NAME}  # fmt: skip
    wait_until(lambda: len(ready_pods(server_pods(cluster, namespace))) == 1, "one replica")

    # 20 waiting requests per pod against a target of 8: the HPA controller asks for
    # ceil(1 x 20 / 8) = 3 replicas (its maximum).
    adapter.values[namespace] = 20
    wait_until(
        lambda: cluster.get("deployment", NAME, namespace)["spec"]["replicas"] == 3,
        "the HPA controller to scale the Deployment to 3",
        timeout_s=60,
    )
    assert any(f"/namespaces/{namespace}/pods/" in path for path in adapter.requests)
    wait_until(
        lambda: (
            (cluster.get("llmd", NAME, namespace).get("status") or {}).get("readyReplicas") == 3
        ),
        "3 ready replicas in the LLMDeployment's status",
        timeout_s=60,
    )
    # The operator no longer owns the count: several resyncs (2 s) leave it at the HPA's 3,
    # though spec.replicas says 1.
    time.sleep(5)
    assert cluster.get("deployment", NAME, namespace)["spec"]["replicas"] == 3
    hpa = cluster.get("hpa", NAME, namespace)
    conditions = {c["type"]: c["status"] for c in hpa["status"]["conditions"]}
    assert conditions["ScalingActive"] == "True", hpa["status"]

    # KEDA instead: its CRD as KEDA ships it; the ScaledObject passes the API server's
    # validation and targets the Deployment; the operator deletes its HPA.
    cluster.kubectl("apply", "-f", str(cluster.crds_dir / "keda.sh_scaledobjects.yaml"))
    wait_until(
        lambda: cluster.run("kubectl", "get", "scaledobjects", "-A", check=False).returncode == 0,
        "the ScaledObject CRD served",
    )
    keda = {**autoscaling, "via": "keda", "prometheusURL": "http://prometheus.monitoring:9090"}
    cluster.kubectl("patch", "llmd", NAME, "-n", namespace, "--type", "merge",
                    "-p", json.dumps({"spec": {"autoscaling": keda}}))  # fmt: skip
    scaled = wait_until(
        lambda: cluster.get("scaledobject", NAME, namespace), "the operator's ScaledObject"
    )
    assert scaled["spec"]["scaleTargetRef"]["name"] == NAME
    assert scaled["spec"]["maxReplicaCount"] == 3
    wait_until(lambda: cluster.get("hpa", NAME, namespace) is None, "the HPA deleted")
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
