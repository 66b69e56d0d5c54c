"""``iterserve serve --simulate ... --telemetry-db FILE``: the real server (the same engine loop
as the real model's, on a thread) writes the three tables to one real SQLite file; tenants
from the header, the ``user`` field or ``default``; a live PUT adds a ``scheduler_config``
row; ``iterserve report`` reads the file."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import run_server
from sim_profiles import make_profile, write_profile

from iterserve.cli import main
from iterserve.server.tenants import resolve_tenant
from iterserve.telemetry.schema import parse_utc

ADMIN = {"Authorization": "Bearer adm"}


def _rows(db: Path, query: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(query)]
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        conn.close()


def _poll(
    db: Path,
    query: str,
    count: int,
    timeout_s: float = 20.0,
    until: Callable[[list[dict[str, Any]]], bool] = lambda rows: True,
) -> list[dict[str, Any]]:
    """The rows of ``query`` once there are ``count`` of them and ``until(rows)`` holds: the
    writer commits in batches, so a test waits for what its assertions need, not for the
    first row."""
    deadline = time.monotonic() + timeout_s
    while len(rows := _rows(db, query)) < count or not until(rows):
        assert time.monotonic() < deadline, f"{len(rows)} rows of {query!r}, wanted {count}"
        time.sleep(0.05)
    return rows


def _decode_tokens(rows: list[dict[str, Any]]) -> int:
    return sum(row["num_decode_tokens"] for row in rows)


def test_resolve_tenant() -> None:
    assert resolve_tenant("team-a", "alice") == "team-a"
    assert resolve_tenant(None, "alice") == "alice"
    assert resolve_tenant("  ", "") == "default"
    assert resolve_tenant(None, None) == "default"
    assert resolve_tenant("x" * 1000, None) == "x" * 256
    # Control characters never reach a row (a terminal would run them in `iterserve report`).
    assert resolve_tenant(None, "\x1b[31mRED\x1b[0m\x1b[2J") == "[31mRED[0m[2J"
    assert resolve_tenant("a\x00b\nc\td", None) == "abcd"
    assert resolve_tenant("\x1b\x07", "alice") == "alice"
    # The ASGI server decodes header bytes as latin-1: UTF-8 ones are read as UTF-8.
    assert resolve_tenant("日本".encode().decode("latin-1"), None) == "日本"
    assert resolve_tenant("caf\xe9", None) == "caf\xe9"  # latin-1 bytes, not UTF-8: kept


def test_serve_writes_the_tables(tmp_path: Path, capsys: Any) -> None:
    profile = write_profile(tmp_path / "p.json", make_profile(fixed_s=0.002))
    db = tmp_path / "telemetry.db"
    flags = ["--simulate", str(profile), "--telemetry-db", str(db), "--admin-token", "adm"]
    with run_server(*flags, startup_timeout_s=30) as server:
        body = {"model": "Test-Model", "prompt": "one two three four", "max_tokens": 5,
                "ignore_eos": True}  # fmt: skip
        with httpx.Client(base_url=server.url, timeout=30) as client:
            r = client.post("/v1/completions", json=body, headers={"X-Tenant-Id": "team-a"})
            assert r.status_code == 200
            header_id = r.headers["x-request-id"]
            r = client.post("/v1/completions", json={**body, "user": "alice", "stream": True,
                                                     "priority": "premium"})  # fmt: skip
            assert r.status_code == 200
            chat = {"model": "Test-Model", "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
            r = client.put("/admin/scheduler_config", json={"max_num_seqs": 7}, headers=ADMIN)
            assert r.status_code == 200
            version = r.json()["config_version"]
            seqs = _poll(db, "SELECT * FROM sequences ORDER BY rowid", 3)
            configs = _poll(db, "SELECT * FROM scheduler_config ORDER BY rowid", 2)
            # 4 decodes x 2 requests (the chat's single token needs none).
            iterations = _poll(
                db,
                "SELECT * FROM scheduler_iterations ORDER BY rowid",
                1,
                until=lambda rows: _decode_tokens(rows) >= 8,
            )
            metrics = client.get("/metrics").text
    assert [s["tenant_id"] for s in seqs] == ["team-a", "alice", "default"]
    assert [s["priority_tier"] for s in seqs] == ["standard", "premium", "standard"]
    first = seqs[0]
    assert first["request_id"] == first["seq_id"] == header_id
    assert first["status"] == "finished" and first["generated_tokens"] == 5
    assert first["max_output_tokens"] == 5 and first["model_version"] == "Test-Model"
    assert first["num_computed_tokens"] == first["prompt_tokens"] + 4  # the last is not fed
    assert first["num_kv_blocks"] == -(-first["num_computed_tokens"] // 16)
    assert first["preemption_count"] == 0
    assert first["ttft_ms"] > 0 and first["tpot_p50_ms"] > 0
    arrival, admitted = parse_utc(first["arrival_time"]), parse_utc(first["admitted_at"])
    completed = parse_utc(first["completed_at"])
    assert arrival <= admitted <= completed and abs(completed - time.time()) < 60
    assert seqs[2]["generated_tokens"] == 1 and seqs[2]["tpot_p50_ms"] is None
    assert [c["config_id"] for c in configs] == [1, version]
    assert [c["max_num_seqs"] for c in configs][1] == 7
    assert json.loads(configs[1]["tiers"])[0]["name"] == "premium"
    settings = json.loads(configs[1]["settings"])
    assert settings["max_num_seqs"] == 7 and settings["preemption_mode"] == "auto"
    assert {"aging_interval_s", "priority_preemption_margin", "max_waiting"} <= set(settings)
    ids = [i["iteration_id"] for i in iterations]
    assert ids == list(range(1, len(ids) + 1))
    assert _decode_tokens(iterations) >= 8
    assert sum(i["num_prefill_tokens"] for i in iterations) > 0
    assert all(i["batch_size"] >= 1 and i["iteration_latency_ms"] > 0 for i in iterations)
    assert 'iterserve_telemetry_records_dropped_total{table="scheduler_iterations"} 0.0' in metrics
    assert main(["report", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "team-a" in out and "alice" in out and "premium" in out


@pytest.mark.model
def test_real_serve_writes_iterations_from_the_engine_process(tmp_path: Path) -> None:
    """``iterserve serve`` on the real default model: ``scheduler_iterations`` comes from the
    engine's own process (``ProcessEngine``), ``sequences`` from the HTTP process."""
    db = tmp_path / "telemetry.db"
    with run_server("--telemetry-db", str(db), "--num-kv-blocks", "64") as server:
        body = {"prompt": "The sky is", "max_tokens": 6, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        (seq,) = _poll(db, "SELECT * FROM sequences", 1)
        iterations = _poll(db, "SELECT * FROM scheduler_iterations ORDER BY rowid", 6)
    assert seq["generated_tokens"] == 6 and seq["model_version"] == "SmolLM2-135M-Instruct"
    assert seq["tenant_id"] == "default" and seq["status"] == "finished"
    # The prompt in one iteration, then one decode token per iteration.
    assert [(i["num_prefill_tokens"], i["num_decode_tokens"]) for i in iterations] == [
        (seq["prompt_tokens"], 0)
    ] + [(0, 1)] * 5
    assert [i["iteration_id"] for i in iterations] == list(range(1, 7))
    assert iterations[-1]["free_kv_blocks"] == 64  # freed when it finished


@pytest.mark.parametrize("kind", ["directory", "corrupt", "unwritable"])
def test_a_bad_telemetry_db_fails_before_the_model_loads(tmp_path: Path, kind: str) -> None:
    from iterserve.config import ConfigError, ServerConfig
    from iterserve.server.launch import serve

    path = {
        "directory": tmp_path,
        "corrupt": tmp_path / "corrupt.db",
        "unwritable": tmp_path / "missing-dir" / "t.db",
    }[kind]
    if kind == "corrupt":
        path.write_bytes(b"not a database" * 100)
    with pytest.raises(ConfigError, match=f"--telemetry-db {path}"):
        serve({}, ServerConfig(telemetry_db=str(path)))
