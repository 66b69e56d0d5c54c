"""The cluster tier: one local control plane per test session (``python -m localcluster``;
docs/kubernetes.md, "Try it on a local control plane"), driven with the real kubectl and helm
as a user types them.

The cluster runs in a process of its own (its pod runner's threads and the pods' processes
die with it); each test works in namespaces of its own. The components are built by
``make test`` before pytest starts (``scripts/k8s-build``, cached); a cold cache built here
would take about 14 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_utils import CHART, RELEASE, RELEASE_NAMESPACE, LocalCluster
from k8s_tools import REPO

START_TIMEOUT_S = 120.0


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One local control plane for the cluster tier (``make cluster``'s, in a temporary
    directory); stopped, with its network namespace, after the tier's last test, so that
    the rest of the suite does not share the machine with it."""
    workdir = tmp_path_factory.mktemp("cluster")
    ready = workdir / "ready.json"
    log = open(workdir / "cluster.log", "wb")  # noqa: SIM115 (the process writes it)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "localcluster",
            "--workdir",
            str(workdir / "state"),
            "--ready-file",
            str(ready),
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        # The checkout's code in the pods too (the pod runner passes PYTHONPATH on), not
        # whatever checkout the virtual environment's editable install points at.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tools")])},
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            code = process.poll()
            if code is not None or time.monotonic() > deadline:
                tail = (workdir / "cluster.log").read_text(errors="replace")[-4000:]
                pytest.fail(f"the local cluster did not start (exit {code}):\n{tail}")
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        yield LocalCluster(
            workdir,
            Path(info["kubeconfig"]),
            info["server"],
            info["namespace"],
            info["pod_cidr"],
            info["host_ip"],
            Path(info["crds_dir"]),
            process,
        )
    finally:
        _stop(process)
        log.close()
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert info["namespace"] not in leftover.split(), "the cluster's network namespace is left"


def install_cluster_wide(cluster: LocalCluster) -> None:
    """The chart cluster-wide (release ``iterserve`` in ``iterserve-system``), waiting for its
    operator pod to be Ready."""
    if cluster.get("namespace", RELEASE_NAMESPACE) is None:
        cluster.kubectl("create", "namespace", RELEASE_NAMESPACE)
    cluster.helm(
        "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        # Each test's LLMDeployments live in a namespace of its own, made after the install.
        "--set", "operator.resyncIntervalS=2", "--set", "secretsInAllNamespaces=true",
        "--wait", "--timeout", "90s",
    )  # fmt: skip


@pytest.fixture(scope="module")
def operator_release(cluster: LocalCluster) -> str:
    """The chart installed cluster-wide and its operator pod Ready (installed again for a
    module when an earlier one took it away): it runs as the chart's ServiceAccount, so the
    chart's RBAC authorizes its every call. Its namespace."""
    installed = cluster.run("helm", "status", RELEASE, "-n", RELEASE_NAMESPACE, check=False)
    if installed.returncode != 0:
        install_cluster_wide(cluster)
    return RELEASE_NAMESPACE
