"""``iterserve report`` on a crafted database: known percentiles per tenant and tier, the
preemptions, the iterations over the prefill ceiling."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from iterserve.cli import main
from iterserve.telemetry.report import build_report
from iterserve.telemetry.schema import COLUMNS, connect, utc_iso

T0 = 1.8e9


def _sequence(i: int, tenant: str, tier: str, ttft: float, tpot: float | None, queue_s: float,
              preemptions: int = 0) -> dict[str, Any]:  # fmt: skip
    return {
        "seq_id": f"s{i}", "request_id": f"r{i}", "tenant_id": tenant, "priority_tier": tier,
        "prompt_tokens": 10, "max_output_tokens": 8, "generated_tokens": 8,
        "num_computed_tokens": 17, "status": "finished", "preemption_count": preemptions,
        "num_kv_blocks": 2, "arrival_time": utc_iso(T0 + i),
        "admitted_at": utc_iso(T0 + i + queue_s), "completed_at": utc_iso(T0 + i + 5),
        "ttft_ms": ttft, "tpot_p50_ms": tpot, "model_version": "m",
    }  # fmt: skip


def _insert(conn: sqlite3.Connection, table: str, row: dict[str, Any]) -> None:
    columns = COLUMNS[table]
    conn.execute(
        f"INSERT INTO {table} VALUES ({', '.join('?' * len(columns))})",
        [row[c] for c in columns],
    )


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "t.db")
    conn = connect(path)
    # tenant a: TTFT 10, 20, ..., 100 ms (p50 55, p99 99.1), queue 1..10 ms, premium
    for i in range(10):
        _insert(conn, "sequences", _sequence(i, "a", "premium", 10.0 * (i + 1), 2.0 + i,
                                             (i + 1) / 1000, preemptions=i % 2))  # fmt: skip
    # tenant b: two requests, one without a second token (no TPOT), standard
    _insert(conn, "sequences", _sequence(20, "b", "standard", 300.0, 7.0, 0.5, preemptions=3))
    _insert(conn, "sequences", _sequence(21, "b", "standard", 500.0, None, 1.5))
    row = _sequence(22, "b", "standard", 0.0, None, 0.0)
    row.update(ttft_ms=None, admitted_at=None, status="aborted")  # never admitted
    _insert(conn, "sequences", row)
    for i, prefill in enumerate([0, 100, 600, 2048, 512, 513]):
        _insert(conn, "scheduler_iterations", {
            "iteration_id": i + 1, "recorded_at": utc_iso(T0 + i), "num_decode_tokens": 4,
            "num_prefill_tokens": prefill, "batch_size": 5, "free_kv_blocks": 10,
            "iteration_latency_ms": 20.0 + i,
        })  # fmt: skip
    _insert(conn, "scheduler_config", {
        "config_id": 1, "max_num_seqs": 8, "max_num_batched_tokens": 2048, "chunk_size": 512,
        "gpu_memory_utilization": 0.9, "kv_watermark": 0.01, "updated_at": utc_iso(T0),
        "tiers": "[]", "settings": "{}",
    })  # fmt: skip
    conn.close()
    return path


def test_percentiles_per_tenant_and_tier(db: str) -> None:
    report = build_report(db, prefill_ceiling=512)
    a = report["by_tenant"]["a"]
    assert a["requests"] == 10 and a["preemptions"] == 5
    assert a["ttft_ms"]["p50"] == pytest.approx(55.0)
    assert a["ttft_ms"]["p99"] == pytest.approx(99.1)  # 90 + 0.91 * 10 (linear)
    assert a["tpot_ms"]["p50"] == pytest.approx(6.5)
    assert a["queue_ms"]["p50"] == pytest.approx(5.5, abs=1e-3)
    assert a["queue_ms"]["p99"] == pytest.approx(9.91, abs=1e-3)
    b = report["by_tenant"]["b"]
    assert b["requests"] == 3 and b["preemptions"] == 3
    assert b["ttft_ms"]["p50"] == pytest.approx(400.0)  # the aborted one has none
    assert b["tpot_ms"]["p50"] == pytest.approx(7.0) == b["tpot_ms"]["p99"]
    assert b["queue_ms"]["p99"] == pytest.approx(1490.0, abs=1e-3)
    assert report["by_tier"]["premium"] == a and report["by_tier"]["standard"] == b
    assert report["num_iterations"] == 6
    assert report["num_iterations_over_ceiling"] == 3
    over = [(r["iteration_id"], r["num_prefill_tokens"]) for r in report["iterations_over_ceiling"]]
    assert over == [(4, 2048), (3, 600), (6, 513)]


def test_default_ceiling_is_the_latest_chunk_size(db: str) -> None:
    assert build_report(db)["prefill_ceiling"] == 512
    assert build_report(db, prefill_ceiling=1000)["num_iterations_over_ceiling"] == 1


def test_cli_text_and_json(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--db", db, "--prefill-ceiling", "600"]) == 0
    text = capsys.readouterr().out
    assert "Per tenant:" in text and "Per tier:" in text
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert lines["a"][:5] == ["a", "10", "5", "55.0", "99.1"]
    assert lines["b"][3] == "400.0"
    assert "Iterations with more than 600 prefill tokens: 1 of 6" in text
    assert main(["report", "--db", db, "--json", "--limit", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["by_tier"]["premium"]["ttft_ms"]["p50"] == pytest.approx(55.0)
    assert len(data["iterations_over_ceiling"]) == 1 and data["num_iterations_over_ceiling"] == 3


def test_missing_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--db", str(tmp_path / "none.db")]) == 2
    assert "no database file" in capsys.readouterr().err


def test_json_has_null_not_nan(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A latency without data (tenant c: one-token requests, no TPOT) is null: JSON has no NaN."""
    conn = connect(db)
    _insert(conn, "sequences", _sequence(30, "c", "premium", 5.0, None, 0.1))
    conn.close()
    assert main(["report", "--db", db, "--json"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert data["by_tenant"]["c"]["tpot_ms"] == {"p50": None, "p99": None}


@pytest.mark.parametrize(
    "columns",
    [
        "seq_id TEXT, request_id TEXT, tenant_id TEXT, priority_tier TEXT, completed_at TEXT, "
        "preemption_count INTEGER",
        "seq_id TEXT, tenant_id TEXT",  # without the indexes' columns too
    ],
)
def test_another_versions_database_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], columns: str
) -> None:
    """A sequences table of another version (columns missing): refused when serving opens it
    (its rows would all fail to insert) and by the report, not read half."""
    path = str(tmp_path / "old.db")
    old = sqlite3.connect(path)
    old.execute(f"CREATE TABLE sequences ({columns})")
    old.commit()
    old.close()
    with pytest.raises(
        sqlite3.DatabaseError, match=r"table sequences lacks columns .*prompt_tokens"
    ):
        connect(path)
    assert main(["report", "--db", path]) == 2
    assert "not a telemetry database of this version" in capsys.readouterr().err


def test_a_database_without_the_tables_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.db"
    path.touch()  # SQLite reads an empty file as an empty database
    assert main(["report", "--db", str(path)]) == 2
    assert "no table sequences: not a telemetry database" in capsys.readouterr().err


def test_a_long_tenant_id_is_cut_in_the_table_not_in_the_json(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "t" * 256  # the longest id the server keeps
    conn = connect(db)
    _insert(conn, "sequences", _sequence(30, long, "standard", 40.0, 3.0, 0.01))
    conn.close()
    assert main(["report", "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) < 200
    assert any(line.strip().startswith("t" * 39 + "…") for line in lines)
    assert main(["report", "--db", db, "--json"]) == 0
    assert long in json.loads(capsys.readouterr().out)["by_tenant"]


@pytest.mark.parametrize("flag", ["--prefill-ceiling", "--limit"])
@pytest.mark.parametrize("value", ["-1", str(2**63), "x"])
def test_counts_out_of_range_are_usage_errors(db: str, flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--db", db, flag, value])
    assert exit_.value.code == 2


def test_a_non_integer_count_names_the_flag_not_the_parser(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["report", "--db", db, "--limit", "abc"])
    err = capsys.readouterr().err
    assert "must be a non-negative integer, got 'abc'" in err and "_count" not in err


def test_a_closed_pipe_is_no_error(db: str) -> None:
    # `iterserve report --json | head -1`: the reader left before the report was written.
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "iterserve.cli", "report", "--db", db, "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
