"""What ``benchmarks.overload`` and ``benchmarks.soak`` share: a server under test, its RSS
and ``/load`` sampled over time, and requests whose every outcome is classified (torch-free).

A server is either started by the benchmark (``iterserve serve`` as a subprocess with the
benchmark's tiers file and admin token, then ``--server-args``: the real default model, or
``--simulate PROFILE``) or attached with ``--url`` (RSS of ``--server-pid``'s process tree,
else the HTTP process's ``process_resident_memory_bytes`` from ``/metrics``).

Every request sent ends as exactly one :class:`Outcome` kind:

- ``completed``: 200, and the response (or stream) ended with a ``finish_reason`` after all
  ``max_tokens`` tokens (``ignore_eos`` and ``min_tokens`` make that length exact);
- ``rejected``: 429 or 503 from admission (``Retry-After`` recorded);
- ``aborted``: the client cancelled it on purpose (``abort_after_s``);
- ``failed``: anything else: another status, an error event, a stream that ended early, a
  connection closed or reset under it (``connection_error``), a client timeout (no end:
  ``stuck``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from iterserve.workload.workloads import corpus_text

ADMIN_TOKEN = "bench-admin-token"
READY_TIMEOUT_S = 300.0  # the real model loads in tens of seconds on a loaded machine
STOP_TIMEOUT_S = 30.0
MIB = 1024 * 1024
# Tiers of a server the benchmarks start: limits a 2-core CPU replica can keep.
BENCH_TIERS: list[dict[str, Any]] = [
    {"name": "premium", "priority": 0, "max_queue_wait_ms": 1000, "ttft_target_ms": 3000},
    {"name": "standard", "priority": 1, "max_queue_wait_ms": 4000, "ttft_target_ms": 8000},
    {"name": "best-effort", "priority": 2, "max_queue_wait_ms": 8000},
]


@dataclass(frozen=True)
class Target:
    """The server under test: base URL, the pid whose process tree is measured (None: RSS
    from ``/metrics``), the admin token (None: no live changes, tiers unknown)."""

    url: str
    pid: int | None
    admin_token: str | None


@contextlib.contextmanager
def server_under_test(args: Any, log_dir: Path) -> Iterator[Target]:
    """The server of ``args.url`` (attached), or one started from ``args.server_args`` on
    ``args.port`` with :data:`BENCH_TIERS` and stopped on exit (SIGTERM, then SIGKILL).

    Raises:
        RuntimeError: the started server exited or was not ready in time.
    """
    if args.url:
        yield Target(args.url.rstrip("/"), args.server_pid, args.admin_token)
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    tiers = log_dir / "tiers.yaml"
    tiers.write_text(yaml.safe_dump(BENCH_TIERS, sort_keys=False))
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-token", ADMIN_TOKEN, "--tiers", str(tiers)]
    cmd += shlex.split(args.server_args)
    with (log_dir / "server.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, url)
        yield Target(url, proc.pid, ADMIN_TOKEN)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} (see its log)")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} was not ready in {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


def admin_headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.admin_token}"} if target.admin_token else {}


def scheduler_settings(target: Target) -> dict[str, Any] | None:
    """``GET /admin/scheduler_config`` (None without an admin token)."""
    if target.admin_token is None:
        return None
    r = httpx.get(target.url + "/admin/scheduler_config", headers=admin_headers(target), timeout=10)
    r.raise_for_status()
    return dict(r.json())


def rss_bytes(target: Target, http: httpx.Client) -> tuple[float, float]:
    """Resident memory of the server: (its whole process tree, the HTTP process alone) when
    the pid is known (the difference is the engine process), else the HTTP process's own
    from ``/metrics``, twice."""
    if target.pid is not None:
        import psutil

        proc = psutil.Process(target.pid)
        own = float(proc.memory_info().rss)
        total = own
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += child.memory_info().rss
        return total, own
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "process_resident_memory_bytes":
            value = float(family.samples[0].value)
            return value, value
    raise RuntimeError("the server exposes no process_resident_memory_bytes; give --server-pid")


@dataclass
class Sampler:
    """Samples RSS and ``/load`` every ``interval_s`` on a thread; ``samples`` rows are
    ``{t_s, phase, rss_mib, http_rss_mib, num_running, num_waiting, used_blocks,
    num_cached_blocks}`` (t from ``t0``; ``rss_mib`` the process tree's)."""

    target: Target
    interval_s: float
    t0: float = field(default_factory=time.perf_counter)
    phase: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)

    def sample(self, http: httpx.Client) -> dict[str, Any]:
        load = http.get("/load").json()
        total, own = rss_bytes(self.target, http)
        row = {
            "t_s": time.perf_counter() - self.t0,
            "phase": self.phase,
            "rss_mib": total / MIB,
            "http_rss_mib": own / MIB,
            "num_running": load["num_running"],
            "num_waiting": load["num_waiting"],
            "used_blocks": load["num_total_blocks"] - load["num_free_blocks"],
            "num_cached_blocks": load["num_cached_blocks"],
        }
        self.samples.append(row)
        return row

    async def run(self, stop: asyncio.Event) -> None:
        with httpx.Client(base_url=self.target.url, timeout=10) as http:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    await asyncio.to_thread(self.sample, http)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)


def wait_idle(target: Target, timeout_s: float) -> dict[str, Any]:
    """Poll ``/load`` until nothing runs or waits and only prefix-cached blocks are held, or
    ``timeout_s`` passes; the last ``/load``."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = dict(httpx.get(target.url + "/load", timeout=10).json())
        used = load["num_total_blocks"] - load["num_free_blocks"]
        idle = load["num_running"] == load["num_waiting"] == load["num_swapped"] == 0
        if (idle and used == 0) or time.monotonic() > deadline:
            load["used_blocks"] = used
            return load
        time.sleep(0.2)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestSpec:
    """One request: prompt text, exact output length, tier, streamed or not, and when the
    client gives up on purpose (None: never)."""

    prompt: str
    max_tokens: int
    tier: str
    stream: bool = True
    abort_after_s: float | None = None


@dataclass
class Outcome:
    """How one request ended (see the module docstring); times in seconds from the run's
    start (``start_s``, ``end_s``) or from the send (``ttft_s``)."""

    tier: str
    stream: bool
    start_s: float
    kind: str = "failed"
    end_s: float | None = None
    status: int | None = None
    retry_after: str | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    error: str | None = None
    ended: bool = False  # an answer, a whole stream, an error event, a closed connection
    connection_error: bool = False  # closed or reset under the request (no timeout)

    @property
    def accepted(self) -> bool:
        """The server took it (200): it must complete, or end because the client left."""
        return self.status == 200


class Prompts:
    """Prompts of about ``n`` tokens (4 characters each, as English text and the simulator's
    tokenizer count them), windows of the benchmarks' corpus at seeded offsets."""

    def __init__(self) -> None:
        self.text = " ".join(corpus_text().split())

    def cut(self, num_tokens: int, offset: int) -> str:
        num_chars = 4 * num_tokens
        start = offset % max(1, len(self.text) - num_chars)
        return self.text[start : start + num_chars]


def request_body(spec: RequestSpec, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "min_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "priority": spec.tier,
        "stream": spec.stream,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(http: httpx.AsyncClient, spec: RequestSpec, model: str, t0: float) -> Outcome:
    """Send ``spec`` and classify how it ended (never raises for the server's behaviour)."""
    out = Outcome(spec.tier, spec.stream, time.perf_counter() - t0)
    try:
        async with asyncio.timeout(spec.abort_after_s):
            await _exchange(http, spec, model, out)
    except TimeoutError:
        out.kind = "aborted" if spec.abort_after_s is not None else "failed"
        out.error = out.error or "client timeout"
    except httpx.TimeoutException as e:  # no end: the server neither answered nor closed
        out.kind, out.error = "failed", f"{type(e).__name__}: {e}"[:200]
    except httpx.HTTPError as e:  # the connection ended (closed or reset) without an answer
        out.kind, out.error, out.ended = "failed", f"{type(e).__name__}: {e}"[:200], True
        out.connection_error = True
    out.end_s = time.perf_counter() - t0
    return out


async def _exchange(http: httpx.AsyncClient, spec: RequestSpec, model: str, out: Outcome) -> None:
    sent = time.perf_counter()
    finished = False
    async with http.stream("POST", "/v1/completions", json=request_body(spec, model)) as r:
        out.status = r.status_code
        out.retry_after = r.headers.get("retry-after")
        if r.status_code != 200:
            out.kind = "rejected" if r.status_code in (429, 503) else "failed"
            out.error = (await r.aread()).decode(errors="replace")[:200]
            out.ended = True
            return
        if not spec.stream:
            data = json.loads(await r.aread())
            out.ttft_s = time.perf_counter() - sent
            out.output_tokens = data["usage"]["completion_tokens"]
            finished = bool(data["choices"][0].get("finish_reason"))
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    out.ended = True
                    return
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if out.ttft_s is None and choice.get("text"):
                        out.ttft_s = time.perf_counter() - sent
                    finished = finished or bool(choice.get("finish_reason"))
    out.ended = True
    if finished and out.output_tokens == spec.max_tokens:
        out.kind = "completed"
    else:
        out.error = f"ended after {out.output_tokens}/{spec.max_tokens} tokens"


def async_client(target: Target, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=target.url, limits=limits, timeout=timeout_s)


def model_name(target: Target) -> str:
    r = httpx.get(target.url + "/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Requests per outcome kind, and the 429s with and without ``Retry-After``."""
    kinds = ("completed", "rejected", "aborted", "failed")
    result = {k: sum(o.kind == k for o in outcomes) for k in kinds}
    result["sent"] = len(outcomes)
    result["accepted"] = sum(o.accepted for o in outcomes)
    result["incomplete"] = sum(o.accepted and o.kind == "failed" for o in outcomes)
    result["stuck"] = sum(o.kind == "failed" and not o.ended for o in outcomes)
    result["connection_errors"] = sum(o.connection_error for o in outcomes)
    result["rejected_429"] = sum(o.status == 429 for o in outcomes)
    result["rejected_429_with_retry_after"] = sum(
        o.status == 429 and o.retry_after is not None and o.retry_after.isdigit() for o in outcomes
    )
    return result


def free_port() -> int:
    """A free loopback port (for a started server without ``--port``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def hang_up_at_random(
    http: httpx.AsyncClient, rng: random.Random, i: int, max_hang_up_s: float, max_words: int
) -> str:
    """One stream (a prompt of 10 to ``max_words`` words, ~3-5 tokens each; 20-200 output
    tokens) that its client leaves after a uniform random time in [0, ``max_hang_up_s``]
    seconds; how it ended for the client: ``finished``, ``left before a token``, ``left
    after tokens`` or ``status N``."""
    words = " ".join(f"w{i}x{k}" for k in range(rng.randint(min(10, max_words), max_words)))
    body = {"prompt": words, "max_tokens": rng.randint(20, 200), "stream": True, "ignore_eos": True}
    received = False
    try:
        async with asyncio.timeout(rng.uniform(0.0, max_hang_up_s)):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                async for line in r.aiter_lines():
                    received = received or line.startswith("data: {")
        return "finished"
    except TimeoutError:
        return "left after tokens" if received else "left before a token"


async def disconnect_storm(
    http: httpx.AsyncClient,
    num_streams: int,
    concurrency: int,
    seed: int,
    max_hang_up_s: float = 1.5,
    max_words: int = 150,
) -> collections.Counter[str]:
    """``num_streams`` :func:`hang_up_at_random` streams, at most ``concurrency`` at once
    (docs/reliability.md, "Disconnect storm"); how many ended each way."""
    rng = random.Random(seed)
    seats = asyncio.Semaphore(concurrency)

    async def one(i: int) -> str:
        async with seats:
            return await hang_up_at_random(http, rng, i, max_hang_up_s, max_words)

    return collections.Counter(await asyncio.gather(*[one(i) for i in range(num_streams)]))
