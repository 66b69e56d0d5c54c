"""Simulated replicas and a router as subprocesses, for ``python -m benchmarks.router``.

:meth:`Fleet.running` starts N replicas (``python -m iterserve.cli serve --simulate``) and a
router in front of them (``python -m iterserve.cli router --backend ...``), waits until every
replica answers ``/ready`` and the router has them all ready, and stops them all on exit:
SIGTERM (the router first, then the replicas), then SIGKILL after a timeout. Their output
goes to one log file each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Running:
    """A started fleet: the replicas' and the router's base URLs, the router's pid, the
    served model id."""

    replica_urls: list[str]
    router_url: str
    router_pid: int
    model: str


@dataclass(frozen=True)
class Fleet:
    """How replicas and routers are started.

    Args:
        base_port: the first replica's port; the others follow, the router after them.
        replica_flags: given to every replica (``--model DIR`` for a tokenizer).
        log_dir: one log file per process and run.
        profile: the replicas' latency profile.
        loopback_hosts: replica ``i`` on ``127.0.0.{i + 2}``, all on ``base_port`` (so that
            they can share one ``--kv-events-port``); the router on ``127.0.0.1:base_port``.
    """

    base_port: int
    replica_flags: list[str]
    log_dir: Path
    profile: str
    loopback_hosts: bool = False

    @contextlib.contextmanager
    def running(
        self,
        num_replicas: int,
        router_flags: list[str],
        speed: float,
        replica_flags: list[str] | None = None,
    ) -> Iterator[Running]:
        """Fresh replicas at ``speed`` and a router with ``router_flags``, ready."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%H%M%S")
        cli = [sys.executable, "-m", "iterserve.cli"]
        host = ["--host", "127.0.0.1"]
        if self.loopback_hosts:
            hosts = [f"127.0.0.{i + 2}" for i in range(num_replicas)]
            ports = [self.base_port] * num_replicas
        else:
            hosts = ["127.0.0.1"] * num_replicas
            ports = [self.base_port + i for i in range(num_replicas)]
        urls = [f"http://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, port in enumerate(ports):
                cmd = [*cli, "serve", "--simulate", self.profile, "--simulate-speed", str(speed)]
                cmd += ["--host", hosts[i], "--port", str(port), "--kv-events-port", "0"]
                cmd += [*self.replica_flags, *(replica_flags or [])]
                procs.append(_start(cmd, self.log_dir / f"{stamp}-replica{i}.log"))
            for proc, url in zip(procs, urls, strict=True):
                _wait_ready(proc, url, lambda r: True)
            router_port = self.base_port + (0 if self.loopback_hosts else num_replicas)
            cmd = [*cli, "router", *host, "--port", str(router_port), *router_flags]
            for url in urls:
                cmd += ["--backend", url]
            router = _start(cmd, self.log_dir / f"{stamp}-router.log")
            procs.append(router)
            router_url = f"http://127.0.0.1:{router_port}"
            _wait_ready(
                router, router_url, lambda r: r.json().get("num_ready_replicas") == num_replicas
            )
            model = str(httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"])
            yield Running(urls, router_url, router.pid, model)
        finally:  # the router first: replicas that go away under it would be ejected (logged)
            _stop(procs[num_replicas:])
            _stop(procs[:num_replicas])


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, ok: Callable[[httpx.Response], bool]
) -> None:
    """Until ``url``'s ``/ready`` answers 200 and ``ok(response)`` holds.

    Raises:
        RuntimeError: the process exited, or it was not ready in time.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} (see its log)")
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200 and ok(r):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} was not ready in {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to all, then SIGKILL to those still running after the timeout."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prefix_cache_totals(url: str) -> tuple[float, float]:
    """A replica's ``iterserve_prefix_cache_hits_total`` and ``..._queries_total`` (prompt
    tokens) so far."""
    values = {"hits": 0.0, "queries": 0.0}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in values:
            if line.startswith(f"iterserve_prefix_cache_{name}_total "):
                values[name] = float(line.split()[1])
    return values["hits"], values["queries"]


def router_counts(url: str) -> dict[str, dict[str, float]]:
    """The router's requests per replica (``iterserve_router_requests_total``, any status) and
    picks per reason (``iterserve_router_picks_total``) so far."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, dict[str, float]] = {"requests_per_replica": {}, "picks_by_reason": {}}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "iterserve_router_requests_total":
                key, label = "requests_per_replica", sample.labels["replica"]
            elif sample.name == "iterserve_router_picks_total":
                key, label = "picks_by_reason", sample.labels["reason"]
            else:
                continue
            counts[key][label] = counts[key].get(label, 0.0) + sample.value
    return counts


def client_args(seed: int, concurrency: int | None = None) -> argparse.Namespace:
    """What :func:`~iterserve.bench.serve.run_load` reads of ``bench serve``'s flags."""
    return argparse.Namespace(
        api_key=None,
        timeout_s=600.0,
        burst=None,
        burst_interval_s=0.0,
        seed=seed,
        concurrency=concurrency,
        no_progress=True,
        endpoint="completions",
        plain=False,
    )
