"""``--telemetry-db`` in the HTTP process over a fake engine client: an aborted request's
``sequences`` row, and the engine process's drop count reaching the metric."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
from fake_engine import FakeEngineClient, run_with_server, until

from iterserve.config import ServerConfig


async def _metric(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    (value,) = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ")]
    return value


def _rows(db: Path) -> list[tuple[Any, ...]]:
    try:
        with sqlite3.connect(db) as conn:
            return conn.execute(
                "SELECT tenant_id, status, generated_tokens, admitted_at, ttft_ms FROM sequences"
            ).fetchall()
    except sqlite3.OperationalError:
        return []


def test_an_aborted_request_and_the_engine_drop_count(tokenizer: Any, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    dropped = 'iterserve_telemetry_records_dropped_total{table="scheduler_iterations"}'

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}
        headers = {"X-Tenant-Id": "t1"}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            lines = r.aiter_lines()
            for _ in range(3):
                await anext(lines)
            assert await _metric(http, dropped) == 0
            fake.num_telemetry_dropped = 5  # type: ignore[attr-defined]
            # Synced from later iterations' messages (the chunks read here may have waited in
            # the socket since before the change: read on until a later one shows it).
            for _ in range(200):
                await anext(lines)
                if await _metric(http, dropped) == 5:
                    break
            assert await _metric(http, dropped) == 5
        await until(lambda: fake.num_live == 0, "the request was not aborted")
        await until(lambda: bool(_rows(db)), "no sequences row")  # the writer wakes every 50 ms

    run_with_server(tokenizer, check, ServerConfig(telemetry_db=str(db)), step_interval_s=0.005)
    ((tenant, status, generated, admitted_at, ttft_ms),) = _rows(db)
    assert (tenant, status) == ("t1", "aborted")
    assert generated >= 2 and admitted_at is not None and ttft_ms >= 0
