"""The components of a local control plane, started and stopped in order.

etcd (loopback) -> kube-apiserver (RBAC and Node authorization, the default admission
plugins plus OwnerReferencesPermissionEnforcement; bound and advertised on the pod network's
host side) -> kube-controller-manager (every default controller; ServiceAccount credentials
per controller) -> kube-scheduler -> kwok (the fake GPU nodes' status and leases). Stop runs
the other way round: an API server whose etcd is already gone hangs in shutdown.
"""

from __future__ import annotations

import logging
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from localcluster import pki
from localcluster.network import PodNetwork
from localcluster.processes import Process, stop_all

logger = logging.getLogger("localcluster")

ROOT = Path(__file__).resolve().parents[2]
API_PORT = 6443
START_TIMEOUT_S = 90.0
RESTART_BACKOFF_S = 2.0

# The fake nodes (docs/kubernetes.md): kwok keeps their status and leases.
NODE_NAMES = ("gpu-node-0", "gpu-node-1")
NODE_CAPACITY = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


class ClusterError(RuntimeError):
    """A component failed to build, start or answer."""


def build_binaries() -> tuple[Path, Path]:
    """(bin directory, kwok stages directory), built or found in the cache by
    ``scripts/k8s-build`` (about 14 minutes cold on 2 cores, seconds when cached).

    Raises:
        ClusterError: the build failed (its output says which module).
    """
    result = subprocess.run(
        [str(ROOT / "scripts" / "k8s-build")], stdout=subprocess.PIPE, stderr=None, text=True
    )
    if result.returncode != 0:
        raise ClusterError(f"scripts/k8s-build failed (exit {result.returncode}): see above")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    return bin_dir, bin_dir.parent / "stages"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ControlPlane:
    """etcd, the API server, the controller manager, the scheduler and kwok for one cluster.

    ``workdir`` receives the certificates, kubeconfigs (``kubeconfig`` is the admin's), etcd's
    data and each component's log under ``logs/``.
    """

    def __init__(self, workdir: Path, network: PodNetwork, bin_dir: Path, stages: Path) -> None:
        self.workdir = workdir
        self.network = network
        self.bin_dir = bin_dir
        self.stages = stages
        self.processes: list[Process] = []
        self._restarted_at: dict[str, float] = {}
        self.server = f"https://{network.host_ip}:{API_PORT}"
        self.pki_dir = workdir / "pki"
        self.admin_kubeconfig = workdir / "kubeconfig"

    # ---------------------------------------------------------------- set-up

    def _write_pki(self) -> None:
        n, d = self.network, self.pki_dir
        ca = pki.CertificateAuthority()
        self.ca = ca
        pki.write_private(d / "ca.crt", ca.cert)
        pki.write_private(d / "ca.key", ca.key)
        serving = ca.issue(
            "kube-apiserver",
            ips=(n.host_ip, n.kubernetes_service_ip, "127.0.0.1"),
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
        )
        pki.write_private(d / "apiserver.crt", serving.cert)
        pki.write_private(d / "apiserver.key", serving.key)
        sa_key, sa_pub = pki.service_account_keys()
        pki.write_private(d / "sa.key", sa_key)
        pki.write_private(d / "sa.pub", sa_pub)
        users = {
            "admin": ("iterserve-admin", ("system:masters",)),
            "controller-manager": ("system:kube-controller-manager", ()),
            "scheduler": ("system:kube-scheduler", ()),
        }
        for name, (user, groups) in users.items():
            client = ca.issue(user, groups)
            pki.write_kubeconfig(
                d / f"{name}.kubeconfig", pki.kubeconfig(self.server, ca.cert, user, client=client)
            )
            if name == "admin":
                pki.write_private(d / "admin.crt", client.cert)
                pki.write_private(d / "admin.key", client.key)
        self.admin_kubeconfig.write_bytes((d / "admin.kubeconfig").read_bytes())
        self.admin_kubeconfig.chmod(0o600)

    def _start(self, name: str, *args: str) -> Process:
        process = Process(
            name, [str(self.bin_dir / name), *args], self.workdir / "logs" / f"{name}.log"
        )
        self.processes.append(process)
        return process

    def start(self) -> None:
        """Start every component and wait for the API server, then create the nodes.

        Raises:
            ClusterError: a component exited or the API server did not answer in time.
        """
        self._write_pki()
        n, d = self.network, self.pki_dir
        etcd_client, etcd_peer = free_port(), free_port()
        self._start(
            "etcd",
            "--name=local",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=local=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync",  # a throwaway cluster: no fsync per write on a slow disk
            "--log-level=warn",
        )
        self._start(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            f"--bind-address={n.host_ip}",
            f"--advertise-address={n.host_ip}",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={d / 'apiserver.crt'}",
            f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={d / 'ca.crt'}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={n.service_cidr}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            # Aggregated APIs (a custom-metrics adapter for the HPA) are reached at their
            # Service's endpoints: no kube-proxy runs, so a Service IP routes nowhere.
            "--enable-aggregator-routing=true",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            "--profiling=false",
        )
        self.wait_ready(START_TIMEOUT_S)
        for name in ("controller-manager", "scheduler"):
            kubeconfig = d / f"{name}.kubeconfig"
            common = [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
            ]
            if name == "controller-manager":
                self._start(
                    "kube-controller-manager",
                    *common,
                    f"--service-account-private-key-file={d / 'sa.key'}",
                    f"--root-ca-file={d / 'ca.crt'}",
                    "--use-service-account-credentials=true",
                    f"--cluster-signing-cert-file={d / 'ca.crt'}",
                    f"--cluster-signing-key-file={d / 'ca.key'}",
                    # Autoscaling tests see the HPA act within seconds (default 15 s).
                    "--horizontal-pod-autoscaler-sync-period=2s",
                )
            else:
                self._start("kube-scheduler", *common)
        self._start(
            "kwok",
            f"--kubeconfig={d / 'admin.kubeconfig'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            f"--config={self._kwok_config()}",
            f"--node-ip={n.node_ip}",
            f"--cidr={n.pod_cidr}",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{free_port()}",
        )
        self._create_nodes()

    def _kwok_config(self) -> Path:
        """kwok's stages (node set-up and heartbeats) in one file: it exits "no stages found"
        without them; no pod stages (the pod runner plays the kubelet)."""
        path = self.workdir / "kwok.yaml"
        path.write_text("\n---\n".join(p.read_text() for p in sorted(self.stages.glob("*.yaml"))))
        return path

    def _create_nodes(self) -> None:
        from kubernetes import client, config

        # Plain dicts in, the client's models out (its stubs want models both ways).
        api: Any = client.CoreV1Api(config.new_client_from_config(str(self.admin_kubeconfig)))
        for name in NODE_NAMES:
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_ANNOTATION: "fake"},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        "nvidia.com/gpu.present": "true",
                    },
                },
                "status": {"capacity": NODE_CAPACITY, "allocatable": NODE_CAPACITY},
            }
            api.create_node(node)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            ready = [
                n.metadata.name
                for n in api.list_node().items
                if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
            ]
            if len(ready) == len(NODE_NAMES):
                return
            self._check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(f"kwok did not make the nodes Ready (ready: {ready})")
            time.sleep(0.2)

    # ---------------------------------------------------------------- state

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        context.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        return context

    def readyz(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"{self.server}/readyz", context=self._ssl_context(), timeout=2
            ) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.readyz():
            self._check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(f"the API server did not become ready in {timeout_s:.0f} s")
            time.sleep(0.2)

    def _check_alive(self) -> None:
        for p in self.processes:
            if p.exit_code() is not None:
                raise ClusterError(f"{p.name} exited with {p.exit_code()}:\n{p.tail()}")

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def supervise(self) -> list[str]:
        """Start again, with the same arguments, each component that exited (in start order,
        so etcd before the API server), as a node's kubelet restarts its static pods: a fault
        test kills the API server and etcd and watches everything recover. Their names."""
        restarted = []
        now = time.monotonic()
        for i, p in enumerate(self.processes):
            if p.exit_code() is None:
                continue
            # A component that keeps failing is started at most once every RESTART_BACKOFF_S.
            if now - self._restarted_at.get(p.name, -RESTART_BACKOFF_S) < RESTART_BACKOFF_S:
                continue
            logger.warning("%s exited with %s; starting it again", p.name, p.exit_code())
            self.processes[i] = Process(p.name, p.argv, p.log)
            self._restarted_at[p.name] = now
            restarted.append(p.name)
        return restarted

    def stop(self) -> None:
        """Every component, the API server before etcd; nothing left running."""
        t0 = time.monotonic()
        clients = [p for p in self.processes if p.name not in ("kube-apiserver", "etcd")]
        stop_all(clients, grace_s=10.0)
        # The API server stops listening at once but then waits in its shutdown for ~15 s
        # more (v1.37, idle, etcd up): SIGKILL after a few seconds. Its state is etcd's.
        stop_all([p for p in self.processes if p.name == "kube-apiserver"], grace_s=3.0)
        stop_all([p for p in self.processes if p.name == "etcd"], grace_s=10.0)
        self.processes.clear()
        logger.info("control plane stopped in %.1f s", time.monotonic() - t0)

    def describe(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "kubeconfig": str(self.admin_kubeconfig),
            "processes": {p.name: p.pid for p in self.processes},
        }
