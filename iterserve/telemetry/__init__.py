"""Telemetry records in SQLite (docs/server.md, "Telemetry records"): the schema, a writer thread
that never blocks its producer, and ``iterserve report``. Standard library only (``sqlite3``),
so the engine process, the HTTP process and the control image all import it."""
