"""The telemetry tables (docs/server.md, "Telemetry records") and how a writer opens the file.

Two processes write one file: the engine process ``scheduler_iterations``, the HTTP process
``sequences`` and ``scheduler_config``. SQLite's write-ahead log lets readers (``iterserve
report``) run beside them, and ``busy_timeout`` makes a writer wait for the other's transaction
instead of failing. Times are UTC ISO 8601 text with microseconds
(``2026-12-01T17:02:03.123456+00:00``); latencies are milliseconds.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime

SEQUENCE_COLUMNS = (
    "seq_id",  # the engine request (one prompt of an HTTP request, its n completions)
    "request_id",  # the HTTP request (X-Request-Id)
    "tenant_id",
    "priority_tier",
    "prompt_tokens",
    "max_output_tokens",
    "generated_tokens",  # summed over the request's n completions
    "num_computed_tokens",  # summed over the completions
    "status",  # finished | aborted | error
    "preemption_count",  # summed over the completions
    "num_kv_blocks",  # blocks its computed tokens held at the end, summed over completions
    "arrival_time",
    "admitted_at",  # NULL when never admitted
    "completed_at",
    "ttft_ms",  # NULL without a token
    "tpot_p50_ms",  # NULL with fewer than 2 tokens
    "model_version",  # the served model id
)
ITERATION_COLUMNS = (
    "iteration_id",  # the engine's iteration number (1, 2, ...; restarts at each start)
    "recorded_at",
    "num_decode_tokens",
    "num_prefill_tokens",
    "batch_size",  # sequences scheduled in the iteration
    "free_kv_blocks",  # after the iteration (free + cached)
    "iteration_latency_ms",
)
CONFIG_COLUMNS = (
    "config_id",  # = config_version
    "max_num_seqs",
    "max_num_batched_tokens",
    "chunk_size",  # long_prefill_token_threshold (0 = no cap)
    "gpu_memory_utilization",
    "kv_watermark",
    "updated_at",
    "tiers",  # JSON: [{name, priority, max_queue_wait_ms, ttft_target_ms}, ...]
    "settings",  # JSON: every live setting of the version (LIVE_SCHEDULER_KEYS), by name
)
COLUMNS = {
    "sequences": SEQUENCE_COLUMNS,
    "scheduler_iterations": ITERATION_COLUMNS,
    "scheduler_config": CONFIG_COLUMNS,
}

TABLES = """
CREATE TABLE IF NOT EXISTS sequences (
    seq_id TEXT NOT NULL, request_id TEXT NOT NULL, tenant_id TEXT NOT NULL,
    priority_tier TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
    max_output_tokens INTEGER NOT NULL, generated_tokens INTEGER NOT NULL,
    num_computed_tokens INTEGER NOT NULL, status TEXT NOT NULL,
    preemption_count INTEGER NOT NULL, num_kv_blocks INTEGER NOT NULL,
    arrival_time TEXT NOT NULL, admitted_at TEXT, completed_at TEXT NOT NULL,
    ttft_ms REAL, tpot_p50_ms REAL, model_version TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS scheduler_iterations (
    iteration_id INTEGER NOT NULL, recorded_at TEXT NOT NULL,
    num_decode_tokens INTEGER NOT NULL, num_prefill_tokens INTEGER NOT NULL,
    batch_size INTEGER NOT NULL, free_kv_blocks INTEGER NOT NULL,
    iteration_latency_ms REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS scheduler_config (
    config_id INTEGER NOT NULL, max_num_seqs INTEGER NOT NULL,
    max_num_batched_tokens INTEGER NOT NULL, chunk_size INTEGER NOT NULL,
    gpu_memory_utilization REAL NOT NULL, kv_watermark REAL NOT NULL,
    updated_at TEXT NOT NULL, tiers TEXT NOT NULL, settings TEXT NOT NULL
);
"""
# After the column check: an older table without an indexed column would fail here with
# SQLite's "no such column" rather than the check's message.
INDEXES = """
CREATE INDEX IF NOT EXISTS sequences_tenant ON sequences (tenant_id, completed_at);
CREATE INDEX IF NOT EXISTS sequences_tier ON sequences (priority_tier, completed_at);
CREATE INDEX IF NOT EXISTS scheduler_iterations_prefill
    ON scheduler_iterations (num_prefill_tokens);
CREATE INDEX IF NOT EXISTS scheduler_config_id ON scheduler_config (config_id);
"""


def connect(path: str, busy_timeout_ms: int = 5000) -> sqlite3.Connection:
    """Open ``path`` for writing: WAL mode, ``busy_timeout``, the schema (idempotent).

    Autocommit mode (``isolation_level=None``): the writer opens its own transactions.

    Raises:
        sqlite3.Error: the file cannot be opened or is not a database.
    """
    conn = sqlite3.connect(path, timeout=busy_timeout_ms / 1000, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
    conn.executescript(TABLES)
    check_columns(conn, path)
    conn.executescript(INDEXES)
    return conn


def check_columns(conn: sqlite3.Connection, path: str) -> None:
    """Every table has every column this version writes (``CREATE TABLE IF NOT EXISTS`` keeps
    an older table as it is; its rows would then all fail to insert, silently dropped).

    Raises:
        sqlite3.DatabaseError: a table is missing (not a telemetry database) or lacks columns
            (another version's database).
    """
    for table, columns in COLUMNS.items():
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if not present:  # the report reads any file: an empty one, another program's
            raise sqlite3.DatabaseError(
                f"{path}: no table {table}: not a telemetry database (written by "
                "`iterserve serve --telemetry-db`)"
            )
        if missing := [c for c in columns if c not in present]:
            raise sqlite3.DatabaseError(
                f"{path}: table {table} lacks columns {', '.join(missing)}: not a telemetry "
                "database of this version (use a new file)"
            )


def utc_iso(epoch_s: float) -> str:
    """``epoch_s`` (seconds since the Unix epoch) as UTC ISO 8601 text."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="microseconds")


def parse_utc(text: str) -> float:
    """The inverse of :func:`utc_iso`: seconds since the Unix epoch."""
    return datetime.fromisoformat(text).timestamp()
