"""Servers of their own: overload (429) and SIGTERM (drain, 503, exit 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx
from server_utils import run_server, stream_completion


async def _stream(
    http: httpx.AsyncClient, i: int, max_tokens: int, prompt: str = "the weather today is"
) -> tuple[int, int, dict[str, str]]:
    """(status, completion tokens streamed, headers) of one streamed completion."""
    body = {"prompt": f"Request {i}: {prompt}", "max_tokens": max_tokens, "ignore_eos": True}
    result = await stream_completion(http, body)
    return result.status, result.completion_tokens, result.headers


def test_overload_beyond_max_waiting_is_429_and_the_rest_complete() -> None:
    with run_server(
        "--dtype", "bfloat16", "--num-kv-blocks", "128", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "64", "--max-waiting", "3",
    ) as server:  # fmt: skip

        async def main() -> list[tuple[int, int, dict[str, str]]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                # Long prompts (5 prefill iterations each at a budget of 64) keep the first
                # requests queued while the rest arrive.
                prompt = "the weather today is sunny and warm. " * 30
                return await asyncio.gather(*[_stream(http, i, 24, prompt) for i in range(12)])

        results = asyncio.run(main())
        statuses = [s for s, _, _ in results]
        assert statuses.count(429) >= 1, statuses
        assert set(statuses) <= {200, 429}
        for status, num_tokens, headers in results:
            if status == 429:
                assert 1 <= int(headers["retry-after"]) <= 60
            else:
                assert num_tokens == 24
        metrics = httpx.get(server.url + "/metrics").text
        rejected = (
            f'iterserve_requests_rejected_total{{reason="queue_full"}} {statuses.count(429)}.0'
        )
        assert rejected in metrics
        assert (
            'iterserve_request_success_total{finished_reason="length"} '
            + str(float(statuses.count(200)))
            in metrics
        )
        # Admin API without --admin-token: 403 saying how to enable it.
        r = httpx.get(server.url + "/admin/scheduler_config")
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]["message"]


def test_sigterm_drains_running_streams_then_exits_zero() -> None:
    with run_server(
        "--dtype", "bfloat16", "--num-kv-blocks", "128", "--shutdown-grace-period-s", "120"
    ) as server:  # fmt: skip

        async def main() -> tuple[list[Any], Any, Any, Any]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                streams = [asyncio.create_task(_stream(http, i, 64)) for i in range(4)]
                deadline = time.monotonic() + 60
                while (await http.get("/load")).json()["num_running"] < 4:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                server.proc.send_signal(signal.SIGTERM)
                while (ready := await http.get("/ready")).status_code == 200:
                    await asyncio.sleep(0.02)
                late = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                health = await http.get("/health")
                return await asyncio.gather(*streams), ready, late, health

        results, ready, late, health = asyncio.run(main())
        assert ready.status_code == 503
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["code"] == "shutting_down"
        assert health.status_code == 200  # alive while draining
        assert [(s, n) for s, n, _ in results] == [(200, 64)] * 4
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


def test_requests_past_the_grace_period_end_with_an_error_event() -> None:
    with run_server(
        "--dtype", "bfloat16", "--num-kv-blocks", "256", "--shutdown-grace-period-s", "1"
    ) as server:  # fmt: skip
        body = {"prompt": "Go on forever:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        server.proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "aborted" and "grace period" in error["message"]
        assert server.proc.wait(60) == 0
        assert "grace period over: aborted 1 requests" in server.log_text()
