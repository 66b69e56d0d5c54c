"""The chart's releases on a real API server: what ``helm uninstall`` leaves (the CRDs only),
and a namespaced release, whose operator acts through Roles in the namespaces it watches and
leaves every other namespace alone."""

from __future__ import annotations

import time

from cluster_utils import (
    CHART,
    NAME,
    RELEASE,
    RELEASE_NAMESPACE,
    LocalCluster,
    condition,
    manifest,
    wait_until,
)


def test_crds_are_established(cluster: LocalCluster, operator_release: str) -> None:
    """Installed by helm from the chart's crds/: accepted (CEL compiled within the API
    server's cost budget) and served."""
    for crd in ("llmdeployments.iterserve.io", "kopfpeerings.kopf.dev",
                "clusterkopfpeerings.kopf.dev"):  # fmt: skip
        conditions = cluster.get("crd", crd)["status"]["conditions"]
        assert {c["type"]: c["status"] for c in conditions}["Established"] == "True"
    explained = cluster.kubectl("explain", "llmd.spec.scheduler.maxNumSeqs")
    assert "max_num_seqs" in explained or "requests" in explained.lower()


def test_helm_uninstall_leaves_only_the_crds(cluster: LocalCluster, operator_release: str) -> None:
    # As the chart's NOTES say: LLMDeployments first, while the operator can still remove
    # their finalizers.
    cluster.kubectl("delete", "llmd", "--all", "--all-namespaces", "--wait=true", "--timeout=90s")
    cluster.helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait")
    selector = f"app.kubernetes.io/instance={RELEASE}"

    def leftovers() -> str:
        cluster_scoped = "clusterroles,clusterrolebindings,clusterkopfpeerings"
        namespaced = "deployments,replicasets,pods,serviceaccounts,roles,rolebindings,services"
        return cluster.kubectl("get", cluster_scoped, "-l", selector, "-o", "name") + (
            cluster.kubectl("get", namespaced, "-l", selector, "-o", "name", "--all-namespaces")
        )

    # The garbage collector removes the ReplicaSet and its pod in the background.
    wait_until(lambda: leftovers().strip() == "", "nothing of the release left")
    assert cluster.get("clusterkopfpeering", "iterserve") is None
    assert cluster.get("crd", "llmdeployments.iterserve.io") is not None  # kept, documented
    assert not cluster.kubectl("get", "llmd", "--all-namespaces", "-o", "name").strip()


def test_a_namespaced_release_acts_only_in_its_namespaces(cluster: LocalCluster) -> None:
    """``watchNamespaces: [team-a]``: Roles there, an LLMDeployment in team-a reconciled,
    one in team-b (not watched) untouched. (After the uninstall above: no cluster-wide
    operator is left to act on either.)"""
    installed = cluster.run("helm", "status", RELEASE, "-n", RELEASE_NAMESPACE, check=False)
    assert installed.returncode != 0, "the cluster-wide release must be gone for this test"
    watched, other, home = (cluster.namespace(p) for p in ("team-a", "team-b", "team-system"))
    cluster.helm(
        "install", "team", str(CHART), "--namespace", home,
        "--set", f"watchNamespaces={{{watched}}}", "--set", "operator.resyncIntervalS=2",
        "--wait", "--timeout", "90s",
    )  # fmt: skip
    try:
        assert cluster.get("role", "team-iterserve", watched) is not None
        cluster.kubectl("apply", "-f", "-", input=manifest(other, replicas=1, gpus=0))
        cluster.kubectl("apply", "-f", "-", input=manifest(watched, replicas=1, gpus=0))
        llmd = wait_until(
            lambda: (
                (o := cluster.get("llmd", NAME, watched)).get("status", {}).get("readyReplicas")
                == 1
                and o
            ),
            "the watched namespace's LLMDeployment ready",
            timeout_s=90,
        )
        assert condition(llmd, "SchedulerConfigApplied")["status"] == "True"
        time.sleep(2)  # two resync periods: a cluster-wide operator would have acted by now
        untouched = cluster.get("llmd", NAME, other)
        assert "status" not in untouched and not untouched["metadata"].get("finalizers")
        assert cluster.get("deployment", NAME, other) is None
        cluster.kubectl("delete", "llmd", NAME, "-n", watched, "--wait=true", "--timeout=60s")
        cluster.kubectl("delete", "llmd", NAME, "-n", other, "--wait=true", "--timeout=60s")
    finally:
        cluster.helm("uninstall", "team", "--namespace", home, "--wait")
