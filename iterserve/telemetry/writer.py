"""A background writer of telemetry rows: a bounded queue its producer never waits on.

The producer (the engine loop between iterations, the HTTP event loop as a request ends) calls
:meth:`TelemetryWriter.submit`, which only ``put_nowait``\\ s a tuple: a full queue drops the row
and counts it (``num_dropped[table]``, and ``on_drop`` for a metric). One thread owns the
connection (sqlite3 connections are per thread) and, every ``flush_interval_s``, writes what
has queued in batches, one transaction each, so a slow disk or the other process's transaction
delays rows, never an iteration.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from iterserve.telemetry.schema import COLUMNS, connect

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 10_000
DEFAULT_MAX_BATCH = 512


def _insert_sql(table: str) -> str:
    columns = COLUMNS[table]
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


class TelemetryWriter:
    """Writes rows of the telemetry tables from its own thread.

    Args:
        path: the SQLite file (created with the schema if absent).
        max_queue: rows waiting at most; past it :meth:`submit` drops.
        max_batch: rows per transaction at most.
        busy_timeout_ms: how long a write waits for another writer's lock before its batch
            is dropped (and counted).
        on_drop: called with (table, number of rows) for every drop, from the producer's
            thread (queue full) or the writer's (a failed write).
        flush_interval_s: the writer wakes this often and writes what has queued.

    Raises:
        sqlite3.Error: ``path`` cannot be opened (checked here, before any row is queued).
    """

    def __init__(
        self,
        path: str,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch: int = DEFAULT_MAX_BATCH,
        busy_timeout_ms: int = 5000,
        on_drop: Callable[[str, int], None] | None = None,
        flush_interval_s: float = 0.05,
    ) -> None:
        self.path = path
        self.max_batch = max_batch
        self.on_drop = on_drop
        self.num_dropped: dict[str, int] = defaultdict(int)
        self.num_written: dict[str, int] = defaultdict(int)
        self.flush_interval_s = flush_interval_s
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue(max_queue)
        self._stop = threading.Event()
        self._conn = connect(path, busy_timeout_ms)
        self._conn.close()  # the schema exists; the thread opens its own connection
        self._busy_timeout_ms = busy_timeout_ms
        self._thread = threading.Thread(target=self._run, name="iterserve-telemetry", daemon=True)
        self._thread.start()

    def submit(self, table: str, row: tuple[Any, ...]) -> bool:
        """Queue one row of ``table`` (values in :data:`~iterserve.telemetry.schema.COLUMNS`
        order); never blocks. False when the queue was full and the row was dropped."""
        try:
            self._queue.put_nowait((table, row))
        except queue.Full:
            self._dropped(table, 1)
            return False
        return True

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the thread (waits up to ``timeout_s``)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _dropped(self, table: str, count: int) -> None:
        self.num_dropped[table] += count
        if self.on_drop is not None:
            try:
                self.on_drop(table, count)
            except Exception:
                logger.exception("telemetry on_drop callback failed")

    def _run(self) -> None:
        # Wakes every flush_interval_s rather than at each row: a thread woken per row would
        # take the GIL from the engine loop once per iteration.
        conn = connect(self.path, self._busy_timeout_ms)
        try:
            while True:
                stopping = self._stop.wait(self.flush_interval_s)
                self._drain(conn)
                if stopping:
                    return
        finally:
            conn.close()

    def _drain(self, conn: sqlite3.Connection) -> None:
        """Write what is queued now, ``max_batch`` rows per transaction."""
        while True:
            batch: list[tuple[str, tuple[Any, ...]]] = []
            try:
                while len(batch) < self.max_batch:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            if batch:
                self._write(conn, batch)
            if len(batch) < self.max_batch:
                return

    def _write(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        by_table: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for table, row in batch:
            by_table[table].append(row)
        try:
            conn.execute("BEGIN IMMEDIATE")
            for table, rows in by_table.items():
                conn.executemany(_insert_sql(table), rows)
            conn.execute("COMMIT")
        except (sqlite3.Error, OverflowError, ValueError, TypeError):
            # Not only sqlite3.Error: a value SQLite cannot bind (an int past 2**63) raised
            # OverflowError, which ended the writer thread and every later row with it.
            logger.exception("telemetry writer: a batch of %d rows was not written", len(batch))
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for table, rows in by_table.items():
                self._dropped(table, len(rows))
            return
        for table, rows in by_table.items():
            self.num_written[table] += len(rows)
