"""The examples in examples/ as a user applies them, unchanged: ``kubectl apply -f`` serves
(the 70B one once its model volume exists), and everything ``iterserve operator render``
prints for them passes the API server's own validation (a server-side dry run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster_utils import LocalCluster, condition, wait_until
from k8s_tools import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _models_volume(namespace: str) -> str:
    """The PersistentVolumeClaim ``models`` the 70B example mounts, bound to a hostPath
    volume (a real cluster's is filled by the Job in docs/kubernetes.md, "Deploy on GPUs")."""
    volume = f"models-{namespace}"
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
         "spec": {"capacity": {"storage": "200Gi"}, "accessModes": ["ReadOnlyMany"],
                  "storageClassName": "", "hostPath": {"path": "/models"},
                  "claimRef": {"namespace": namespace, "name": "models"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": "models", "namespace": namespace},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                  "volumeName": volume, "resources": {"requests": {"storage": "200Gi"}}}},
    ]})  # fmt: skip


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_applied_as_it_is_serves(
    cluster: LocalCluster, operator_release: str, example: Path
) -> None:
    (document,) = yaml.safe_load_all(example.read_text())
    name = document["metadata"]["name"]
    namespace = cluster.namespace(example.stem[:20])
    if "pvc" in document["spec"]["model"]["source"]:
        cluster.kubectl("apply", "-f", "-", input=_models_volume(namespace))
    cluster.kubectl("apply", "-n", namespace, "-f", str(example))
    replicas = document["spec"].get("replicas", 1)

    def ready() -> dict | None:
        llmd = cluster.get("llmd", name, namespace)
        return llmd if (llmd.get("status") or {}).get("readyReplicas") == replicas else None

    wait_until(ready, f"{example.name} ready", timeout_s=90)

    def applied() -> dict | None:
        # The Deployment may count a pod ready one reconcile before the operator lists it
        # ready and pushes the settings (the condition is Unknown, NoReadyPods, meanwhile).
        found = condition(cluster.get("llmd", name, namespace), "SchedulerConfigApplied")
        return found if found["status"] == "True" else None

    wait_until(applied, f"{example.name}'s settings applied", timeout_s=30)

    # What `operator render` prints, validated by the API server (nothing is created).
    rendered = subprocess.run(
        [str(Path(sys.executable).with_name("iterserve")), "operator", "render", "-n", namespace,
         str(example)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    dry_run = cluster.run("kubectl", "apply", "-n", namespace, "--dry-run=server", "-f", "-",
                          input=rendered, check=False)  # fmt: skip
    assert dry_run.returncode == 0, dry_run.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered)}
    assert {"ConfigMap", "Deployment", "Service", "Role", "PodDisruptionBudget"} <= kinds
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
