"""The telemetry writer on a real SQLite file: rows land in batches, the schema is idempotent,
and a producer facing a full queue (the writer stuck behind another process's lock) drops and
counts instead of waiting."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from iterserve.telemetry.schema import COLUMNS, connect, parse_utc, utc_iso
from iterserve.telemetry.writer import TelemetryWriter


def _iteration(i: int) -> tuple[object, ...]:
    return (i, utc_iso(1.7e9 + i), 3, 10 * i, 2, 50, 1.5)


def _wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_schema_is_idempotent_and_in_wal_mode(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    connect(db).close()
    conn = connect(db)  # a second open (the other process) changes nothing
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == set(COLUMNS)
    for table, columns in COLUMNS.items():
        got = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        assert tuple(got) == columns
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"sequences_tenant", "sequences_tier", "scheduler_iterations_prefill"} <= indexes


def test_rows_are_written_and_flushed_on_close(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    writer = TelemetryWriter(db, max_batch=7)
    for i in range(1, 101):
        assert writer.submit("scheduler_iterations", _iteration(i))
    writer.close()
    rows = sqlite3.connect(db).execute("SELECT * FROM scheduler_iterations").fetchall()
    assert [r[0] for r in rows] == list(range(1, 101))
    assert rows[4] == _iteration(5)
    assert writer.num_written["scheduler_iterations"] == 100
    assert parse_utc(rows[0][1]) == 1.7e9 + 1


def test_full_queue_drops_and_counts_without_waiting(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    connect(db).close()
    # Another writer (the other process) holds the write lock: our writer's insert waits.
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    drops: list[tuple[str, int]] = []
    writer = TelemetryWriter(
        db,
        max_queue=4,
        max_batch=1,  # it takes one row at a time: exactly 4 more fit
        busy_timeout_ms=20_000,
        on_drop=lambda t, n: drops.append((t, n)),
    )
    assert writer.submit("scheduler_iterations", _iteration(1))
    _wait_for(lambda: writer.num_queued == 0)  # the writer took it and is stuck on the lock
    times = []
    results = []
    for i in range(2, 12):  # 4 fit, 6 are dropped
        start = time.perf_counter()
        results.append(writer.submit("scheduler_iterations", _iteration(i)))
        times.append(time.perf_counter() - start)
    assert results == [True] * 4 + [False] * 6
    assert writer.num_dropped["scheduler_iterations"] == 6
    assert drops == [("scheduler_iterations", 1)] * 6
    assert max(times) < 0.05  # put_nowait: no wait for the lock (held for seconds)
    blocker.execute("COMMIT")
    blocker.close()
    writer.close()
    ids = [
        r[0] for r in sqlite3.connect(db).execute("SELECT iteration_id FROM scheduler_iterations")
    ]
    assert ids == [1, 2, 3, 4, 5]


def test_a_failed_write_drops_its_batch_and_counts_it(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    connect(db).close()
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    writer = TelemetryWriter(db, busy_timeout_ms=50)  # gives up on the lock quickly
    writer.submit("scheduler_iterations", _iteration(1))
    _wait_for(lambda: writer.num_dropped["scheduler_iterations"] == 1)
    blocker.execute("COMMIT")
    writer.submit("scheduler_iterations", _iteration(2))  # the writer carries on
    writer.close()
    ids = [
        r[0] for r in sqlite3.connect(db).execute("SELECT iteration_id FROM scheduler_iterations")
    ]
    assert ids == [2]


def test_a_row_sqlite_cannot_bind_is_dropped_and_the_writer_carries_on(tmp_path: Path) -> None:
    # An int past 2**63 raises OverflowError (not an sqlite3.Error): it ended the thread.
    db = str(tmp_path / "t.db")
    writer = TelemetryWriter(db)
    writer.submit("scheduler_iterations", (1, utc_iso(1.7e9), 3, 2**70, 2, 50, 1.5))
    _wait_for(lambda: writer.num_dropped["scheduler_iterations"] == 1)
    writer.submit("scheduler_iterations", _iteration(2))
    writer.close()
    ids = [
        r[0] for r in sqlite3.connect(db).execute("SELECT iteration_id FROM scheduler_iterations")
    ]
    assert ids == [2]
