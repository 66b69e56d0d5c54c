"""The local cluster's pod network: clusters on one machine never collide (a slot each), and
what a crashed cluster left is removed by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

from cluster_utils import wait_until
from k8s_tools import REPO
from localcluster.network import PodNetwork, namespace_exists


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_two_clusters_take_different_slots_and_release_them() -> None:
    first = PodNetwork.acquire()
    try:
        second = PodNetwork.acquire()
        try:
            assert first.slot != second.slot
            assert {first.host_ip, second.host_ip} == {
                f"198.18.{2 * first.slot}.1",
                f"198.18.{2 * second.slot}.1",
            }
            assert namespace_exists(first.namespace) and namespace_exists(second.namespace)
            ip = second.add_pod_ip("pod-uid")
            assert ip.startswith(f"198.18.{2 * second.slot + 1}.")
            answer = subprocess.run(
                [*second.netns_command(), "ip", "-4", "addr", "show", second.pod_veth],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            assert f"{ip}/32" in answer.stdout
            # The host reaches a process bound to a pod address over the veth.
            server = subprocess.Popen(
                [*second.netns_command(), sys.executable, "-m", "http.server", "--bind", ip,
                 "18080"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                wait_until(lambda: _answers(f"http://{ip}:18080/"), "the pod address to answer")
            finally:
                server.kill()
                server.wait()
        finally:
            second.release()
        assert not namespace_exists(second.namespace)
    finally:
        first.release()
    assert not namespace_exists(first.namespace)


def test_what_a_killed_cluster_left_is_removed_by_the_next() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from localcluster.network import PodNetwork
            network = PodNetwork.acquire()
            print(network.namespace, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "tools")},
    )  # fmt: skip
    assert holder.stdout is not None
    namespace = holder.stdout.readline().strip()
    assert namespace_exists(namespace)
    holder.send_signal(signal.SIGKILL)  # no chance to clean up
    holder.wait()
    assert namespace_exists(namespace)  # left behind, its slot's lock now free
    network = PodNetwork.acquire()  # cleans every stale slot first
    try:
        assert not namespace_exists(namespace) or network.namespace == namespace
    finally:
        network.release()
    assert not namespace_exists(namespace)
