"""The cluster tier's helpers: :class:`LocalCluster` (a running local control plane and the
kubectl/helm commands a user types at it) and :func:`wait_until`."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from k8s_tools import REPO, k8s_tool

T = TypeVar("T")
CHART = REPO / "charts" / "iterserve"
# The cluster-wide release the tests install (tests/cluster/conftest.py).
RELEASE, RELEASE_NAMESPACE = "iterserve", "iterserve-system"


def wait_until(
    check: Callable[[], T], what: str, timeout_s: float = 60.0, period_s: float = 0.25
) -> T:
    """Poll ``check`` until it returns something truthy; that value.

    Raises:
        AssertionError: ``timeout_s`` passed (the message names ``what`` and the last value).
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except (subprocess.CalledProcessError, KeyError, IndexError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}: {last!r}")
        time.sleep(period_s)


@dataclass
class LocalCluster:
    """A running local cluster and the commands a user would type at it."""

    workdir: Path
    kubeconfig: Path
    server: str
    network_namespace: str
    pod_cidr: str
    host_ip: str  # the pod network's host side (the API server's address)
    crds_dir: Path  # third-party CRDs the build fetched (KEDA's ScaledObject)
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def run(
        self,
        tool: str,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout_s: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl`` or ``helm`` with this cluster's admin kubeconfig."""
        return subprocess.run(
            [str(k8s_tool(tool)), *args],
            env=self.env(),
            input=input,
            text=True,
            capture_output=True,
            check=check,
            timeout=timeout_s,
        )

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        result = self.run("kubectl", *args, check=False, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result.stdout if result.returncode == 0 else result.stderr

    def helm(self, *args: str, timeout_s: float = 120.0) -> str:
        result = self.run("helm", *args, check=False, timeout_s=timeout_s)
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: {result.stderr}")
        return result.stdout

    def get(self, kind: str, name: str = "", namespace: str | None = None) -> Any:
        """``kubectl get -o json``: the object, or a List's items; None when not found."""
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if namespace is not None:
            args += ["-n", namespace]
        result = self.run("kubectl", *args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        data = json.loads(result.stdout)
        return data["items"] if data.get("kind", "").endswith("List") else data

    def namespace(self, prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        return name

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = (self.workdir / "cluster.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def _processes() -> Iterator[tuple[int, str, str]]:
    """(pid, working directory, command line) of every process we may inspect."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        yield int(entry.name), cwd, cmdline


def pod_pid(cluster: LocalCluster, namespace: str, pod: str) -> int:
    """The pid of a pod's container process (the first started in the pod's directory)."""
    marker = f"/pods/{namespace}_{pod}_"
    pids = sorted(
        pid for pid, cwd, cmdline in _processes() if marker in cwd and "iterserve" in cmdline
    )
    assert pids, f"no process for pod {namespace}/{pod}"
    return pids[0]


def component_pid(cluster: LocalCluster, name: str) -> int:
    """The pid of a control plane component (etcd, kube-apiserver, ...) of this cluster."""
    pids = [
        pid
        for pid, _, cmdline in _processes()
        if cmdline.split(" ")[0].endswith(f"/{name}") and str(cluster.workdir) in cmdline
    ]
    assert len(pids) == 1, f"{name}: {pids}"
    return pids[0]


# ------------------------------------------------------------------ LLMDeployments

NAME = "chat"


def manifest(namespace: str, replicas: int = 2, gpus: int = 4, **spec: Any) -> str:
    body = {
        "apiVersion": "iterserve.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"name": "llama-3-70b", "source": {"hostPath": "/models/llama-3-70b"}},
            "image": "ghcr.io/iterserve/iterserve:0.1.0-cuda",
            "replicas": replicas,
            "resources": {"gpus": gpus},
            "router": {"replicas": 1},
            **spec,
        },
    }
    return json.dumps(body)


def condition(llmd: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in llmd["status"]["conditions"] if c["type"] == kind)


def server_pods(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    pods = cluster.get("pods", namespace=namespace) or []
    return [
        p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "server"
    ]


def ready_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        p
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions") or []
        )
    ]


def secret(cluster: LocalCluster, namespace: str, name: str, key: str) -> str:
    data = cluster.get("secret", name, namespace)["data"]
    return base64.b64decode(data[key]).decode()


def pod_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8000"


def admin_url(pod: dict[str, Any]) -> str:
    """The pod's admin listener (``--admin-port``, the container port named admin)."""
    return f"http://{pod['status']['podIP']}:8001"


def live_settings(pod: dict[str, Any], admin_token: str) -> dict[str, Any]:
    """``GET /admin/scheduler_config`` on the pod's admin port with the first (current) of
    the N-admin Secret's tokens, one per line."""
    response = httpx.get(
        f"{admin_url(pod)}/admin/scheduler_config",
        headers={"Authorization": f"Bearer {admin_token.split()[0]}"},
        timeout=5,
    )
    response.raise_for_status()
    return dict(response.json())


def patch_spec(
    cluster: LocalCluster, namespace: str, spec: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """``kubectl patch llmd NAME --type merge -p {"spec": spec}`` (not checked: a refusal is
    a test's expectation too)."""
    body = json.dumps({"spec": spec})
    return cluster.run("kubectl", "patch", "llmd", NAME, "-n", namespace, "--type", "merge",
                       "-p", body, check=False)  # fmt: skip
