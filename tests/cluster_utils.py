"""The cluster tier's helpers: :class:`LocalCluster` (a running local control plane and the
kubectl/helm commands a user types at it) and :func:`wait_until`."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from k8s_tools import k8s_tool

T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, timeout_s: float = 60.0, period_s: float = 0.25) -> T:
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
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def run(self, tool: str, *args: str, check: bool = True, input: str | None = None,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """``kubectl`` or ``helm`` with this cluster's admin kubeconfig."""
        return subprocess.run(
            [str(k8s_tool(tool)), *args], env=self.env(), input=input, text=True,
            capture_output=True, check=check, timeout=timeout_s,
        )  # fmt: skip

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
