"""Flags of ``iterserve report`` (argparse only: building the CLI imports no sqlite3)."""

from __future__ import annotations

import argparse


def _count(text: str) -> int:
    """A non-negative integer SQLite can compare with (at most 2**63 - 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {text}")
    return value


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="the file of serve --telemetry-db")
    parser.add_argument(
        "--prefill-ceiling",
        type=_count,
        default=None,
        help="list iterations with more prefill tokens than this (default: the latest "
        "scheduler_config's chunk_size when > 0)",
    )
    parser.add_argument("--limit", type=_count, default=20, help="iterations listed at most")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
