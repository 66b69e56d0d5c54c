"""The pod network of a local control plane: a network namespace and a veth pair.

EndpointSlices refuse loopback addresses, so pods cannot live on 127.0.0.0/8. Each cluster
takes a *slot* (0-7, a lock file per slot, so a developer's and CI's clusters on one machine
never collide) and builds, in RFC 2544's benchmarking range (198.18.0.0/15, never routed)::

    host                                   network namespace iterserve-<slot>
    veth isv<slot>h  198.18.<2s>.1/23 <--> veth isv<slot>n  198.18.<2s>.2/23  (the nodes' IP)
    (API server binds here)                 + one /32 per pod: 198.18.<2s+1>.2-254

    Services: 198.19.<slot>.0/24 (no kube-proxy: nothing answers on them)

Slot 0 is the documented layout (docs/kubernetes.md, "Addresses": API server on 198.18.0.1, pods
from 198.18.1.0/24). The namespace has no default route: its processes reach the host side and each
other, nothing else. A slot whose lock is free but whose namespace exists was left by a crash: it is
removed (with every process inside) before reuse. Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

NUM_SLOTS = 8
LOCK_DIR = Path(os.environ.get("ITERSERVE_CLUSTER_LOCK_DIR", "/run/iterserve-cluster"))


class NetworkError(RuntimeError):
    """The pod network cannot be built here (no root, no ``ip``, every slot taken)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def namespace_exists(name: str) -> bool:
    return name in _ip("netns", "list", check=False).stdout.split()


def kill_namespace_processes(name: str) -> None:
    """SIGKILL every process inside network namespace ``name``."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_namespace(name: str) -> None:
    """The namespace, its processes and its veth pair (deleting one end deletes both)."""
    if namespace_exists(name):
        kill_namespace_processes(name)
        _ip("netns", "delete", name, check=False)


def check_can_build() -> None:
    """Raises NetworkError (saying why) where no pod network can be built: not root, no
    ``ip`` command. Cheap: called before the control plane's build, not after it."""
    if os.geteuid() != 0:
        raise NetworkError(
            "the local control plane needs root (CAP_NET_ADMIN) for its pod network "
            "namespace: run it as root"
        )
    if shutil.which("ip") is None:
        raise NetworkError("the `ip` command (iproute2) is not installed")


def clean_stale() -> list[str]:
    """Remove the namespaces of slots nobody holds (left by a crash); their names."""
    removed = []
    for slot in range(NUM_SLOTS):
        stale = PodNetwork(slot)  # names only: nothing is built
        if not namespace_exists(stale.namespace):
            continue
        with open(LOCK_DIR / f"slot-{slot}.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live cluster's
            remove_namespace(stale.namespace)
            _ip("link", "delete", stale.host_veth, check=False)
            removed.append(stale.namespace)
    return removed


@dataclass
class PodNetwork:
    """One slot's addresses (see the module docstring) and the pod IPs handed out."""

    slot: int
    _lock: IO[str] | None = None
    _pod_ips: dict[str, str] = field(default_factory=dict)  # pod uid -> IP

    @property
    def namespace(self) -> str:
        return f"iterserve-{self.slot}"

    @property
    def host_veth(self) -> str:
        return f"isv{self.slot}h"

    @property
    def pod_veth(self) -> str:
        return f"isv{self.slot}n"

    @property
    def host_ip(self) -> str:
        """The API server's address (bound and advertised)."""
        return f"198.18.{2 * self.slot}.1"

    @property
    def node_ip(self) -> str:
        """The namespace's own address: every fake node's InternalIP and pods' hostIP."""
        return f"198.18.{2 * self.slot}.2"

    @property
    def pod_cidr(self) -> str:
        return f"198.18.{2 * self.slot + 1}.0/24"

    @property
    def service_cidr(self) -> str:
        return f"198.19.{self.slot}.0/24"

    @property
    def kubernetes_service_ip(self) -> str:
        """The first address of the Service range (the ``kubernetes`` Service's)."""
        return str(ipaddress.ip_network(self.service_cidr)[1])

    def netns_command(self) -> list[str]:
        """The prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]

    # ---------------------------------------------------------------- pod IPs

    def add_pod_ip(self, pod_uid: str) -> str:
        """A free IP of the pod range, on the namespace's veth, for this pod."""
        if pod_uid in self._pod_ips:
            return self._pod_ips[pod_uid]
        taken = set(self._pod_ips.values())
        for host in ipaddress.ip_network(self.pod_cidr).hosts():
            ip = str(host)
            if ip not in taken and not ip.endswith(".1"):
                break
        else:
            raise NetworkError(f"no free pod IP in {self.pod_cidr}")
        self._in_namespace("addr", "add", f"{ip}/32", "dev", self.pod_veth)
        self._pod_ips[pod_uid] = ip
        return ip

    def remove_pod_ip(self, pod_uid: str) -> None:
        ip = self._pod_ips.pop(pod_uid, None)
        if ip is not None:
            self._in_namespace("addr", "del", f"{ip}/32", "dev", self.pod_veth, check=False)

    def _in_namespace(self, *args: str, check: bool = True) -> None:
        _ip("-n", self.namespace, *args, check=check)

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def acquire(cls, wait_s: float = 0.0) -> PodNetwork:
        """Lock a free slot (waiting up to ``wait_s`` for one) and build its network.

        Raises:
            NetworkError: not root, ``ip`` missing, or every slot is taken.
        """
        check_can_build()
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        clean_stale()
        deadline = time.monotonic() + wait_s
        while True:
            for slot in range(NUM_SLOTS):
                lock = open(LOCK_DIR / f"slot-{slot}.lock", "a+")  # noqa: SIM115 (held open)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lock.close()
                    continue
                network = cls(slot, lock)
                network._build()
                return network
            if time.monotonic() >= deadline:
                raise NetworkError(f"all {NUM_SLOTS} local cluster slots are in use")
            time.sleep(1.0)

    def _build(self) -> None:
        remove_namespace(self.namespace)  # left by a crash: the slot's lock was free
        _ip("link", "delete", self.host_veth, check=False)
        try:
            _ip("netns", "add", self.namespace)
            _ip("link", "add", self.host_veth, "type", "veth", "peer", "name", self.pod_veth)
            _ip("link", "set", self.pod_veth, "netns", self.namespace)
            _ip("addr", "add", f"{self.host_ip}/23", "dev", self.host_veth)
            _ip("link", "set", self.host_veth, "up")
            self._in_namespace("addr", "add", f"{self.node_ip}/23", "dev", self.pod_veth)
            self._in_namespace("link", "set", self.pod_veth, "up")
            self._in_namespace("link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.release()
            raise NetworkError(
                f"building the pod network failed: ip {e.args[1]}: {e.stderr}"
            ) from e

    def release(self) -> None:
        """Remove the namespace (and any process left in it) and free the slot."""
        remove_namespace(self.namespace)
        _ip("link", "delete", self.host_veth, check=False)
        self._pod_ips.clear()
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
