"""Start a real ``iterserve serve`` on loopback for tests (the real default model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

API_KEY = "sk-test-key"
ADMIN_TOKEN = "admin-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(num_ports: int, attempts: int = 100) -> int:
    """The first of ``num_ports`` consecutive ports free on 127.0.0.1 now (for tools that take
    a base port and count up). Drawn below Linux's ephemeral range (32768 and up), where
    nothing is handed out by the kernel, so they stay free unless someone binds them
    explicitly. Raises RuntimeError after ``attempts`` draws that each met a busy port."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 32768 - num_ports)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + num_ports):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {num_ports} consecutive free ports in {attempts} draws")


class Server:
    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        url: str,
        log: Path,
        kv_events_port: int | None = None,
    ) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.kv_events_port = kv_events_port  # where it publishes KV events (None: off)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


ITERSERVE = [sys.executable, "-m", "iterserve.cli"]  # the CLI of the interpreter running the tests


@contextmanager
def run_server(
    *flags: str,
    startup_timeout_s: float = 240.0,
    port: int | None = None,
    command: str = "serve",
    host: str = "127.0.0.1",
    own_group: bool = False,
) -> Iterator[Server]:
    """``iterserve COMMAND --host HOST --port <port or a free one> *flags`` (``serve`` or
    ``router``), ready; stopped on exit. A server publishes KV events when ``flags`` give a
    ``--kv-events-port`` (its ``kv_events_port``; servers on other loopback hosts,
    127.0.0.2..., can share one port). ``own_group``: in a process group (session) of its own,
    which a test may signal as a terminal's Ctrl-C does (``os.killpg``)."""
    port = port or free_port()
    log = Path(tempfile.mkstemp(prefix="iterserve-server-", suffix=".log")[1])
    cmd = [*ITERSERVE, command, "--host", host]
    cmd += ["--port", str(port), *flags]
    kv_events_port = None
    if "--kv-events-port" in flags:
        kv_events_port = int(flags[flags.index("--kv-events-port") + 1]) or None
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
            start_new_session=own_group,
        )
    server = Server(proc, f"http://{host}:{port}", log, kv_events_port)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()}")
            try:
                if httpx.get(server.url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in time:\n{server.log_text()}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGINT)  # second signal: exit without draining
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.unlink(missing_ok=True)


@dataclass
class Streamed:
    """What a client saw of one streamed completion."""

    status: int
    headers: dict[str, str]
    completion_tokens: int = 0  # from the usage chunk
    finish_reasons: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)  # error events in the stream


async def stream_completion(
    http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Streamed:
    """POST a streamed completion (usage included) and read it to the end."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        result = Streamed(r.status_code, dict(r.headers))
        if r.status_code != 200:
            await r.aread()
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.errors.append(chunk["error"])
                continue
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            result.finish_reasons += [
                c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]
            ]
    return result


async def read_story_events(http: Any, i: int, started: asyncio.Event) -> list[str]:
    """A long streamed completion's ``data:`` payloads (``started`` set at the first), read
    until the stream ends: what a client sees when the replica fails under it."""
    body = {"prompt": f"Story {i}:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


def write_secret_volume(directory: Path, tokens: str, generation: int) -> Path:
    """The layout a kubelet gives a Secret volume: ``token -> ..data/token``, ``..data`` a
    symlink to a timestamped directory, swapped atomically on an update."""
    data_dir = directory / f"..2026_{generation}"
    data_dir.mkdir()
    (data_dir / "token").write_text(tokens)
    (directory / "..data_tmp").symlink_to(data_dir.name)
    os.replace(directory / "..data_tmp", directory / "..data")
    if not (directory / "token").is_symlink():
        (directory / "token").symlink_to("..data/token")
    return directory / "token"


@contextmanager
def simulated_replicas(profile_file: Path, n: int, *flags: str) -> Iterator[list[Server]]:
    """``n`` simulated replicas (``serve --simulate profile_file *flags``), ready; stopped on
    exit."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(run_server("--simulate", str(profile_file), *flags))
            for _ in range(n)
        ]


def assert_kv_events_port_in_use_fails(serve: list[str], timeout_s: float = 60) -> None:
    """``serve`` (a command line up to its flags) given a KV-events port another socket holds
    exits 2 with one line naming it, no traceback."""
    import zmq

    busy = zmq.Context.instance().socket(zmq.PUB)
    busy.setsockopt(zmq.LINGER, 0)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        cmd = [*serve, "--host", "127.0.0.1", "--port", str(free_port())]
        cmd += ["--kv-events-port", str(port)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    finally:
        busy.close()
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"iterserve serve: error: cannot publish KV events on tcp://127.0.0.1:{port}: "
        "Address already in use"
    ), last
    assert "Traceback" not in proc.stderr, proc.stderr
