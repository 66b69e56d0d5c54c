"""A real ``iterserve serve --tensor-parallel-size 3`` on the default model (gloo on the CPU):
the ``openai`` client, streaming, an abort that frees its blocks, a live config change; then
one worker killed mid-stream: every stream ends with an error, the server exits with code 1
and no process of its tree remains (docs/tensor-parallel.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
from server_utils import (
    ADMIN_TOKEN,
    API_KEY,
    ITERSERVE,
    Server,
    free_port,
    read_story_events,
    run_server,
)

from iterserve.server.launch import ENGINE_DEAD_EXIT_S

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def tp_server() -> Iterator[Server]:
    with run_server(
        "--tensor-parallel-size", "3",
        "--dtype", "float32",
        "--num-kv-blocks", str(NUM_BLOCKS),
        "--max-num-seqs", "8",
        "--api-key", API_KEY,
        "--admin-token", ADMIN_TOKEN,
    ) as s:  # fmt: skip
        yield s


def tree(server: Server) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def workers(server: Server) -> list[psutil.Process]:
    return [p for p in tree(server) if "iterserve.executor.tp_worker" in p.cmdline()]


def test_the_openai_client_streams_from_a_tp3_server(tp_server: Server) -> None:
    assert len(workers(tp_server)) == 2  # ranks 1 and 2; rank 0 is the engine process
    client = openai.OpenAI(base_url=tp_server.url + "/v1", api_key=API_KEY, max_retries=0)
    kwargs = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12}
    full = client.completions.create(temperature=0, **kwargs)  # type: ignore[call-overload]
    assert full.choices[0].text.strip() and full.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(temperature=0, stream=True, **kwargs)  # type: ignore[call-overload]
        if c.choices
    )
    assert streamed == full.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert chat.choices[0].message.content


def test_an_abort_frees_its_blocks_and_a_live_config_change_applies(tp_server: Server) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=tp_server.url, timeout=60, headers=AUTH) as http:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 5:
                        break  # disconnect mid-stream
            load = {}
            for _ in range(100):
                load = (await http.get("/load")).json()
                if load["num_running"] == 0 and load["num_free_blocks"] == NUM_BLOCKS:
                    break
                await asyncio.sleep(0.05)
            assert load["num_free_blocks"] == NUM_BLOCKS, load

            url = "/admin/scheduler_config"
            r = await http.put(url, json={"max_num_seqs": 1}, headers=ADMIN)
            assert r.status_code == 200, r.text
            streams = [
                asyncio.create_task(http.post("/v1/completions", json={**body, "max_tokens": 16}))
                for _ in range(3)
            ]
            seen = []
            while not all(s.done() for s in streams):
                load = (await http.get("/load")).json()
                seen.append((load["num_running"], load["num_waiting"]))
                await asyncio.sleep(0.05)
            assert [s.result().status_code for s in streams] == [200] * 3
            assert max(running for running, _ in seen) == 1, seen
            assert max(waiting for _, waiting in seen) >= 1, seen
            r = await http.put(url, json={"max_num_seqs": 8}, headers=ADMIN)
            assert r.status_code == 200, r.text

    asyncio.run(main())


def test_a_degree_the_model_does_not_split_into_is_a_one_line_error_and_exit_2() -> None:
    """Found only once the engine process has read the model (9 query heads, 3 KV heads)."""
    cmd = [*ITERSERVE, "serve", "--tensor-parallel-size", "2", "--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("iterserve serve: error: ") and "num_attention_heads" in last, last
    assert "Traceback" not in proc.stderr, proc.stderr  # uvicorn's lifespan traceback is dropped


def test_sigterm_exits_zero_and_leaves_no_process() -> None:
    with run_server("--tensor-parallel-size", "3", "--num-kv-blocks", "32") as server:
        processes = tree(server)
        assert len(workers(server)) == 2
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        _, alive = psutil.wait_procs(processes, timeout=10)
        assert [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_killed_worker_fails_every_stream_and_the_server_exits(tp_server: Server) -> None:
    """Last in the module: it ends the server."""
    processes = tree(tp_server)
    worker = workers(tp_server)[0]

    async def main() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=tp_server.url, timeout=60, headers=AUTH) as http:
            started = [asyncio.Event() for _ in range(3)]
            streams = [
                asyncio.create_task(read_story_events(http, i, e)) for i, e in enumerate(started)
            ]
            for e in started:
                await asyncio.wait_for(e.wait(), 60)
            worker.send_signal(signal.SIGKILL)
            events = await asyncio.wait_for(asyncio.gather(*streams), 20)
            assert (await http.get("/health")).status_code == 503
            return events

    killed_at = time.monotonic()
    for stream in asyncio.run(main()):
        assert stream[-1] == "[DONE]"
        error = json.loads(stream[-2])["error"]
        assert error["type"] == "service_unavailable_error", error
    assert tp_server.proc.wait(ENGINE_DEAD_EXIT_S + 20) == 1
    assert time.monotonic() - killed_at < ENGINE_DEAD_EXIT_S + 30
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    log = tp_server.log_text()
    assert "tensor-parallel worker rank" in log and "killed by SIGKILL" in log, log[-3000:]
