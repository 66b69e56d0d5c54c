"""A real ``iterserve serve`` (the real default model) whose engine process is killed
mid-stream, and the exit that follows over the fake engine (docs/reliability.md, "Engine
crash"). The other way round, the server killed under its engine, is in
tests/test_process_engine.py."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx
import psutil
import pytest
from fake_engine import FakeEngineClient, serve_in_process, until
from server_utils import Server, read_story_events, run_server

from iterserve.config import ServerConfig
from iterserve.server.launch import ENGINE_DEAD_EXIT_S, GracefulServer

FLAGS = ("--dtype", "float32", "--num-kv-blocks", "128", "--max-num-seqs", "8")


def engine_process(server: Server) -> psutil.Process:
    """The engine child of a server (multiprocessing's spawned child, not its resource
    tracker)."""
    children = psutil.Process(server.proc.pid).children()
    [engine] = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    return engine


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive (zombies count as gone) after up to ``timeout_s``."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.model
def test_a_killed_engine_ends_every_stream_and_the_server_exits_non_zero() -> None:
    with run_server(*FLAGS) as server:
        tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children()]
        engine = engine_process(server)

        async def main() -> tuple[list[list[str]], httpx.Response, httpx.Response, float]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                started = [asyncio.Event() for _ in range(3)]
                streams = [
                    asyncio.create_task(read_story_events(http, i, e))
                    for i, e in enumerate(started)
                ]
                for e in started:
                    await asyncio.wait_for(e.wait(), 60)
                engine.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                events = await asyncio.wait_for(asyncio.gather(*streams), 10)
                print(
                    f"streams ended {time.monotonic() - killed_at:.2f} s after the kill; ", end=""
                )
                late = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                health = await http.get("/health")
                return events, late, health, killed_at

        events, late, health, killed_at = asyncio.run(main())
        for stream in events:
            assert stream[-1] == "[DONE]"
            error = json.loads(stream[-2])["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "service_unavailable_error"
            assert "killed by SIGKILL" in error["message"]
        assert late.status_code == 503
        assert late.json()["error"]["type"] == "service_unavailable_error"
        assert health.status_code == 503
        assert server.proc.wait(ENGINE_DEAD_EXIT_S + 10) == 1
        exited_after_s = time.monotonic() - killed_at
        print(f"the server exited (code 1) {exited_after_s:.2f} s after it")
        assert exited_after_s < ENGINE_DEAD_EXIT_S + 10
        assert wait_gone(tree, 10) == []
        assert "the engine process died (killed by SIGKILL)" in server.log_text()


def test_a_dead_engine_exits_the_server_with_code_1_after_a_while(tokenizer: Any) -> None:
    """Over the fake engine: in the seconds between the engine's death and the exit, /health
    and new requests are 503 (what a probe and a router see)."""
    fake = FakeEngineClient(tokenizer, time.monotonic, step_interval_s=0.01)
    servers: list[GracefulServer] = []

    def make_server(config: Any, app: Any) -> GracefulServer:
        servers.append(GracefulServer(config, app, grace_period_s=30))
        return servers[0]

    async def main() -> float:
        async with (
            serve_in_process(fake, ServerConfig(), make_server=make_server) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            assert (await http.get("/health")).status_code == 200
            fake.kill()
            died_at = time.monotonic()
            assert (await http.get("/health")).status_code == 503
            late = await http.post("/v1/completions", json={"prompt": "x"})
            assert late.status_code == 503
            await until(lambda: servers[0].should_exit, "the server exits", ENGINE_DEAD_EXIT_S + 5)
            return time.monotonic() - died_at

    exited_after_s = asyncio.run(main())
    assert ENGINE_DEAD_EXIT_S <= exited_after_s < ENGINE_DEAD_EXIT_S + 1
    assert servers[0].exit_code == 1
