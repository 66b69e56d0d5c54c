"""The real side of ``iterserve bench fidelity``: a fresh ``iterserve serve`` per replay, one
warm-up request, the trace through ``bench serve``'s client, and what the server itself
reports around it (its queue-time histogram and iteration counter, scraped before and after;
its processes' CPU time from ``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from iterserve.bench.fidelity_compare import (
    queue_buckets,
    queue_ms,
    rejections_by_tier,
)
from iterserve.bench.fidelity_shapes import ShapeTrace
from iterserve.bench.serve import run_load
from iterserve.workload.stats import SLO, summarize, summarize_by_tier


class FidelityError(Exception):
    """The run cannot go on: a refused calibration, a server that did not start."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_pids(pid: int) -> dict[str, int]:
    """The HTTP process and its engine child (``ProcessEngine`` spawns it)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    engine = [int(c) for c in children if "spawn_main" in _cmdline(int(c))]
    return {"http": pid, "engine": engine[0]} if engine else {"http": pid}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def free_port() -> int:
    """A TCP port free on the loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


@contextmanager
def server_process(
    cmd: list[str], url: str, ready_path: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` started with its output in ``log``, yielded once ``url + ready_path`` answers
    200; terminated (killed after 60 s) on exit, and on SIGTERM on the way out (as Ctrl-C).

    Raises:
        FidelityError: it exited, or was not ready within 300 s (with its log's tail).
    """
    name = Path(cmd[0]).name if "-m" not in cmd else "the server"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    previous = _exit_on_sigterm()
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise FidelityError(f"{name} exited with {proc.returncode}; {log}:\n{_tail(log)}")
            try:
                if httpx.get(url + ready_path, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise FidelityError(f"{name} was not ready in 300 s; {log}:\n{_tail(log)}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def real_server(port: int, flags: list[str], log: Path) -> Iterator[tuple[str, int]]:
    """``iterserve serve`` on the default model, ready; (its URL, its pid); stopped on exit.

    Args:
        port: its port (0: a free one).
        log: where its output goes.

    Raises:
        FidelityError: it exited, or was not ready within 300 s (with its log's tail).
    """
    port = port or free_port()
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *flags]
    # A private server on the loopback for our own client, which sends no key.
    env = {k: v for k, v in os.environ.items() if k != "ITERSERVE_API_KEY"}
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, "/ready", log, env) as proc:
        yield url, proc.pid


def _exit_on_sigterm() -> Any:
    """Make SIGTERM raise ``SystemExit`` (so the server is stopped on the way out, as for
    Ctrl-C) while a real server runs; the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _exit)


def client_args(seed: int, concurrency: int | None = None) -> argparse.Namespace:
    """``bench serve``'s client settings for a private real server: no key, no progress bar,
    completions, open loop unless ``concurrency``."""
    return argparse.Namespace(
        api_key=None,
        timeout_s=1800.0,
        burst=None,
        burst_interval_s=0.0,
        seed=seed,
        concurrency=concurrency,
        no_progress=True,
        endpoint="completions",
        plain=False,
    )


def warm_up(url: str) -> str:
    """The served model's id, after one request of a one-word prompt and 2 tokens (the first
    forward's one-off costs).

    Raises:
        FidelityError: the server did not answer either.
    """
    try:
        models = httpx.get(url + "/v1/models", timeout=30)
        models.raise_for_status()
        model = str(models.json()["data"][0]["id"])
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
        httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise FidelityError(f"the real server at {url} did not serve a warm-up request: {e}") from e
    return model


def real_replay(
    trace: ShapeTrace, flags: list[str], args: argparse.Namespace, log: Path
) -> dict[str, Any]:
    """``trace`` through a fresh real server: its summary and per-tier summaries (with the
    server's own queue times), 429s per tier, CPU and iteration counts."""
    slo = SLO()
    with real_server(args.port, flags, log) as (url, pid):
        model = warm_up(url)
        pids = _server_pids(pid)
        before, it_before = scrape(url)
        cpu_before = {name: cpu_seconds(p) for name, p in pids.items()}
        records, wall, cpu = asyncio.run(
            run_load(url, trace.requests, model, client_args(args.seed), trace.rate)
        )
        server_cpu = {
            name: (cpu_seconds(p) - cpu_before[name]) / max(wall, 1e-9) for name, p in pids.items()
        }
        after, it_after = scrape(url)
    summary = summarize(records, wall, slo)
    summary["queue_ms"] = queue_ms(before, after)
    by_tier = summarize_by_tier(records, wall, slo)
    for tier, tier_summary in by_tier.items():
        # The client labels requests sent without a tier "default", the server by the tier it
        # serves them in ("standard"): with one tier in the run, all of the server's series.
        only = len(by_tier) == 1
        tier_summary["queue_ms"] = queue_ms(before, after, None if only else [tier])
    num_iterations = it_after[1] - it_before[1]
    return {
        "summary": summary,
        "by_tier": by_tier,
        "rejected_429": rejections_by_tier(records),
        "errors": [r.error for r in records if r.error and r.status != 429][:10],
        "client_cpu_fraction": cpu / max(wall, 1e-9),
        # Cores busy on average: the HTTP process, the engine process.
        "server_cpu_cores": server_cpu,
        "iterations": num_iterations,
        "mean_iteration_ms": (it_after[0] - it_before[0]) / max(1, num_iterations) * 1e3,
    }


def scrape(url: str) -> tuple[dict[str, dict[float, float]], tuple[float, float]]:
    """The queue-time histogram and ``iterserve_iteration_latency_seconds`` (sum, count)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for name in values:
            if line.startswith(f"iterserve_iteration_latency_seconds_{name} "):
                values[name] = float(line.split()[1])
    return queue_buckets(text), (values["sum"], values["count"])
