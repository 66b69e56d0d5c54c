"""Overload (429 with Retry-After from the measured drain rate), the grace period after
SIGTERM (over a fake engine), and SIGTERM on a real server process (drain, 503, exit 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest
from fake_engine import FakeClock, FakeEngineClient, run_with_server, serve_in_process, until
from server_utils import run_server, stream_completion

from iterserve.config import SchedulerConfig, ServerConfig
from iterserve.server.launch import GracefulServer


def test_overload_is_429_with_retry_after_from_the_drain_rate(tokenizer: Any) -> None:
    clock = FakeClock(1000.0)
    body = {"prompt": "Hi", "max_tokens": 1}

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        def post(b: dict[str, Any] = body) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(http.post("/v1/completions", json=b))

        first = [post() for _ in range(3)]
        await until(lambda: fake.num_live == 3, "3 queued")
        r = await http.post("/v1/completions", json=body)
        # Nothing has left the queue yet: the drain rate is unknown, Retry-After is 1 s.
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "the queue is full (3 requests waiting, max_waiting=3); retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
        # The three leave the queue 10 s apart: 3 requests in 20 s = 0.15 requests/s.
        fake.max_running = 1
        for i in range(3):
            if i:
                clock.advance(10)
            fake.step()  # admits one of them (in the order the server queued them)
            # Its answer is back, so its first token was seen at this clock.
            await until(lambda i=i: sum(t.done() for t in first) == i + 1, "one more answered")
        assert [(await t).status_code for t in first] == [200] * 3
        second = [post() for _ in range(3)]
        await until(lambda: fake.num_live == 3, "3 queued again")
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"  # 1 / 0.15 s
        r = await http.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
        assert r.status_code == 429 and r.headers["retry-after"] == "14"  # 2 / 0.15 s
        for _ in range(3):
            fake.step()
        assert [(await t).status_code for t in second] == [200] * 3
        metrics = (await http.get("/metrics")).text
        assert 'iterserve_requests_rejected_total{reason="queue_full"} 3.0' in metrics
        assert 'iterserve_request_success_total{finished_reason="length"} 6.0' in metrics

    scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_waiting=3)
    run_with_server(
        tokenizer, check, clock=clock, auto_step=False, max_running=0, scheduler=scheduler
    )


def test_requests_past_the_grace_period_end_with_an_error_event(tokenizer: Any) -> None:
    """First SIGTERM: /ready 503, new requests 503; the stream still running after the grace
    period ends with an 'aborted' error event, then the server exits by itself."""
    fake = FakeEngineClient(tokenizer, time.monotonic, step_interval_s=0.01)
    servers: list[GracefulServer] = []

    def make_server(config: Any, app: Any) -> GracefulServer:
        servers.append(GracefulServer(config, app, grace_period_s=0.3))
        return servers[0]

    async def main() -> None:
        async with (
            serve_in_process(fake, ServerConfig(), make_server=make_server) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            body = {"prompt": "Go on", "max_tokens": 100_000 // 100, "stream": True}
            events = []
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 2:
                        servers[0].handle_exit(signal.SIGTERM, None)
                        ready = await http.get("/ready")
                        assert ready.status_code == 503
                        late = await http.post("/v1/completions", json={"prompt": "x"})
                        assert late.status_code == 503 and late.headers["retry-after"] == "1"
                        assert late.json()["error"]["code"] == "shutting_down"
                        assert (await http.get("/health")).status_code == 200
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "aborted" and "grace period" in error["message"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not servers[0].should_exit:
                assert loop.time() < deadline, "the server did not shut down"
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(fake.aborted) == 1


async def _stream(http: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, int]:
    body = {"prompt": f"Request {i}: the weather today is", "max_tokens": max_tokens}
    result = await stream_completion(http, {**body, "ignore_eos": True})
    return result.status, result.completion_tokens


@pytest.mark.model
def test_ctrl_c_drains_running_streams_then_exits_zero() -> None:
    """Ctrl-C: SIGINT to the whole process group, the engine process included (which ignores
    it: it died of a KeyboardInterrupt and every stream failed). The server drains as on
    SIGTERM (the same handler; SIGTERM to the server alone: the tensor-parallel server's
    test)."""
    with run_server(
        "--dtype", "bfloat16", "--num-kv-blocks", "128", "--shutdown-grace-period-s", "120",
        own_group=True,
    ) as server:  # fmt: skip

        async def main() -> tuple[list[Any], Any, Any, Any]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                streams = [asyncio.create_task(_stream(http, i, 64)) for i in range(4)]
                deadline = time.monotonic() + 60
                while (await http.get("/load")).json()["num_running"] < 4:
                    assert time.monotonic() < deadline, "4 streams never ran at once"
                    await asyncio.sleep(0.02)
                os.killpg(server.proc.pid, signal.SIGINT)
                deadline = time.monotonic() + 30
                while (ready := await http.get("/ready")).status_code == 200:
                    assert time.monotonic() < deadline, "/ready never turned 503"
                    await asyncio.sleep(0.02)
                late = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                health = await http.get("/health")
                return await asyncio.gather(*streams), ready, late, health

        results, ready, late, health = asyncio.run(main())
        assert ready.status_code == 503
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert late.json()["error"]["code"] == "shutting_down"
        assert health.status_code == 200  # alive while draining
        assert results == [(200, 64)] * 4
        assert server.proc.wait(60) == 0
        log = server.log_text()
        assert "draining 4 active requests" in log and "drained; shutting down" in log
        # Structured access log, one JSON line per request, without the prompt text.
        access = [
            json.loads(line[line.index("{") :])
            for line in log.splitlines()
            if "iterserve.access" in line
        ]
        generations = [a for a in access if a["path"] == "/v1/completions"]
        assert len(generations) == 5 and {a["status"] for a in generations} == {200, 503}
        assert all(a["request_id"] and "duration_ms" in a for a in generations)
        assert "weather" not in log
        assert "KeyboardInterrupt" not in log and "engine process died" not in log
