"""A local Kubernetes control plane for trying the operator and for the cluster test tier.

``make cluster`` (``python -m localcluster``) builds the components from source (cached),
creates the pod network, starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok with two fake GPU nodes, and runs the pod runner (the kubelet for
iterserve's pods): docs/kubernetes.md, "Try it on a local
control plane". :class:`Cluster` is the whole of it, started and stopped in order.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from localcluster.control_plane import ClusterError, ControlPlane, build_binaries
from localcluster.network import NetworkError, PodNetwork, check_can_build

__all__ = ["Cluster", "ClusterError", "NetworkError"]

logger = logging.getLogger("localcluster")


class Cluster:
    """The pod network, the control plane and the pod runner, in ``workdir``.

    Raises (from :meth:`start`):
        NetworkError: no root, or every slot is taken.
        ClusterError: a component failed to build or start.
    """

    def __init__(self, workdir: Path, slot_wait_s: float = 60.0) -> None:
        self.workdir = workdir
        self.slot_wait_s = slot_wait_s
        self.network: PodNetwork | None = None
        self.control_plane: ControlPlane | None = None
        self.pod_runner: Any = None

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    def start(self) -> None:
        check_can_build()  # before a build of minutes
        bin_dir, stages = build_binaries()
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        try:
            self.network = PodNetwork.acquire(self.slot_wait_s)
            self.control_plane = ControlPlane(self.workdir, self.network, bin_dir, stages)
            self.control_plane.start()
            from localcluster.pod_runner import PodRunner

            self.pod_runner = PodRunner(
                self.control_plane.admin_kubeconfig,
                self.control_plane.server,
                self.control_plane.pki_dir / "ca.crt",
                self.network,
                self.workdir,
            )
            self.pod_runner.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Pods first, then the control plane (API server before etcd), then the network."""
        if self.pod_runner is not None:
            self.pod_runner.stop()
            self.pod_runner = None
        if self.control_plane is not None:
            self.control_plane.stop()
            self.control_plane = None
        if self.network is not None:
            self.network.release()
            self.network = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
