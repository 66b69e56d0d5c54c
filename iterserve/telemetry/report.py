"""``iterserve report --db FILE``: what an operator asks of the telemetry tables (docs/server.md,
"Telemetry records").

Per tenant and per priority tier: requests, preemptions, and p50/p99 of TTFT, TPOT and queue
time; then the iterations whose prefill tokens exceeded a ceiling (the failure mode "chunked
prefill off or misconfigured, long prompts stall decode"). Percentiles are computed in Python
over the ``sequences`` rows with linear interpolation (numpy's default, as ``iterserve bench``
reports them): TTFT over the requests that produced a token, TPOT over each request's own
median gap (``tpot_p50_ms``, requests with at least 2 tokens), queue time = ``admitted_at -
arrival_time`` over admitted requests. Aborted and failed requests count too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from iterserve.telemetry.schema import check_columns, parse_utc
from iterserve.workload.stats import percentile

_METRICS = ("ttft_ms", "tpot_ms", "queue_ms")


def _group_stats(rows: Iterable[sqlite3.Row], key: str) -> dict[str, dict[str, Any]]:
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        name = row[key]
        counts[name][0] += 1
        counts[name][1] += row["preemption_count"]
        if row["ttft_ms"] is not None:
            values[name]["ttft_ms"].append(row["ttft_ms"])
        if row["tpot_p50_ms"] is not None:
            values[name]["tpot_ms"].append(row["tpot_p50_ms"])
        if row["admitted_at"] is not None:
            queue_s = parse_utc(row["admitted_at"]) - parse_utc(row["arrival_time"])
            values[name]["queue_ms"].append(max(0.0, queue_s * 1000))
    out = {}
    for name in sorted(counts):
        stats: dict[str, Any] = {"requests": counts[name][0], "preemptions": counts[name][1]}
        for metric in _METRICS:
            got = values[name][metric]
            stats[metric] = {"p50": percentile(got, 50), "p99": percentile(got, 99)}
        out[name] = stats
    return out


def build_report(db: str, prefill_ceiling: int | None = None, limit: int = 20) -> dict[str, Any]:
    """The report of the database ``db`` as a dict (what ``--json`` prints).

    Args:
        db: an SQLite file written by ``iterserve serve --telemetry-db``.
        prefill_ceiling: iterations with more prefill tokens are listed; None: the latest
            ``scheduler_config`` row's ``chunk_size`` when it is > 0, else none are listed.
        limit: iterations listed at most (the count covers all of them).

    Returns:
        ``{"by_tenant": {tenant: stats}, "by_tier": {tier: stats}, "prefill_ceiling": int |
        None, "num_iterations": int, "num_iterations_over_ceiling": int,
        "iterations_over_ceiling": [row, ...]}``; stats are ``{"requests", "preemptions",
        "ttft_ms", "tpot_ms", "queue_ms"}``, each latency ``{"p50", "p99"}`` in milliseconds
        (NaN without data).

    Raises:
        FileNotFoundError: no such file.
        sqlite3.Error: not a telemetry database.
    """
    if not Path(db).is_file():
        raise FileNotFoundError(f"no database file {db}")
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        check_columns(conn, db)
        rows = conn.execute("SELECT * FROM sequences").fetchall()
        if prefill_ceiling is None:
            latest = conn.execute(
                "SELECT chunk_size FROM scheduler_config ORDER BY rowid DESC LIMIT 1"
            ).fetchone()
            if latest is not None and latest[0] > 0:
                prefill_ceiling = int(latest[0])
        num_iterations = conn.execute("SELECT count(*) FROM scheduler_iterations").fetchone()[0]
        over: list[dict[str, Any]] = []
        num_over = 0
        if prefill_ceiling is not None:
            where = "FROM scheduler_iterations WHERE num_prefill_tokens > ?"
            num_over = conn.execute(f"SELECT count(*) {where}", (prefill_ceiling,)).fetchone()[0]
            query = f"SELECT * {where} ORDER BY num_prefill_tokens DESC, rowid LIMIT ?"
            over = [dict(r) for r in conn.execute(query, (prefill_ceiling, limit))]
    finally:
        conn.close()
    return {
        "by_tenant": _group_stats(rows, "tenant_id"),
        "by_tier": _group_stats(rows, "priority_tier"),
        "prefill_ceiling": prefill_ceiling,
        "num_iterations": num_iterations,
        "num_iterations_over_ceiling": num_over,
        "iterations_over_ceiling": over,
    }


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


MAX_NAME_WIDTH = 40  # a longer tenant id is cut in the text table (--json keeps it whole)


def _name(name: str) -> str:
    return name if len(name) <= MAX_NAME_WIDTH else name[: MAX_NAME_WIDTH - 1] + "…"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def format_report(report: dict[str, Any]) -> str:
    """The report as text tables (milliseconds; ``-`` where there is no data; names past
    :data:`MAX_NAME_WIDTH` characters cut with ``…``)."""
    parts = []
    for title, key, label in (("tenant", "by_tenant", "tenant"), ("tier", "by_tier", "tier")):
        header = [label, "requests", "preemptions"]
        header += [f"{m[:-3]}_{p}_ms" for m in _METRICS for p in ("p50", "p99")]
        rows = [
            [_name(name), str(s["requests"]), str(s["preemptions"])]
            + [_ms(s[m][p]) for m in _METRICS for p in ("p50", "p99")]
            for name, s in report[key].items()
        ]
        parts.append(f"Per {title}:\n" + (_table(header, rows) if rows else "(no sequences)"))
    ceiling = report["prefill_ceiling"]
    if ceiling is None:
        parts.append("Iterations over a prefill ceiling: no ceiling (pass --prefill-ceiling N)")
    else:
        over = report["iterations_over_ceiling"]
        title = (
            f"Iterations with more than {ceiling} prefill tokens: "
            f"{report['num_iterations_over_ceiling']} of {report['num_iterations']}"
        )
        header = ["iteration_id", "recorded_at", "prefill", "decode", "batch", "latency_ms"]
        rows = [
            [
                str(r["iteration_id"]),
                r["recorded_at"],
                str(r["num_prefill_tokens"]),
                str(r["num_decode_tokens"]),
                str(r["batch_size"]),
                f"{r['iteration_latency_ms']:.1f}",
            ]
            for r in over
        ]
        parts.append(title + ("\n" + _table(header, rows) if rows else ""))
    return "\n\n".join(parts)


def main(args: argparse.Namespace) -> int:
    """Print the report; 0, or 2 when the database cannot be read."""
    try:
        report = build_report(args.db, args.prefill_ceiling, args.limit)
    except (FileNotFoundError, sqlite3.Error) as e:
        print(f"iterserve report: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(_without_nan(report), indent=2) if args.json else format_report(report)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `iterserve report ... | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0


def _without_nan(value: Any) -> Any:
    """``value`` with NaN (a latency without data) as None: JSON has no NaN (``null``)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nan(v) for v in value]
    return value
