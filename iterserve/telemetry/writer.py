"""A background writer of telemetry rows: a bounded queue its producer never waits on.

The producer (the engine loop between iterations, the HTTP event loop as a request ends) calls
:meth:`TelemetryWriter.submit`, which only ``put_nowait``\\ s a tuple: a full queue drops the row
and counts it (``num_dropped[table]``, and ``on_drop`` for a metric). One thread owns the
connection (sqlite3 connections are per thread) and writes what has queued in batches, one
transaction each, so a slow disk or the other process's transaction delays rows, never an
iteration.
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

_STOP = None


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
    ) -> None:
        self.path = path
        self.max_batch = max_batch
        self.on_drop = on_drop
        self.num_dropped: dict[str, int] = defaultdict(int)
        self.num_written: dict[str, int] = defaultdict(int)
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(max_queue)
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
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            logger.warning("telemetry writer: queue still full at close; rows are lost")
            return
        self._thread.join(timeout_s)

    def _dropped(self, table: str, count: int) -> None:
        self.num_dropped[table] += count
        if self.on_drop is not None:
            try:
                self.on_drop(table, count)
            except Exception:
                logger.exception("telemetry on_drop callback failed")

    def _run(self) -> None:
        conn = connect(self.path, self._busy_timeout_ms)
        try:
            while True:
                item = self._queue.get()
                batch = []
                while item is not _STOP:
                    batch.append(item)
                    if len(batch) >= self.max_batch:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    self._write(conn, batch)
                if item is _STOP:
                    return
        finally:
            conn.close()

    def _write(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        by_table: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for table, row in batch:
            by_table[table].append(row)
        try:
            conn.execute("BEGIN IMMEDIATE")
            for table, rows in by_table.items():
                conn.executemany(_insert_sql(table), rows)
            conn.execute("COMMIT")
        except sqlite3.Error:
            logger.exception("telemetry writer: a batch of %d rows was not written", len(batch))
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for table, rows in by_table.items():
                self._dropped(table, len(rows))
            return
        for table, rows in by_table.items():
            self.num_written[table] += len(rows)
