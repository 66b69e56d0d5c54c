"""Flags of ``iterserve report`` (argparse only: building the CLI imports no sqlite3)."""

from __future__ import annotations

import argparse


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="the file of serve --telemetry-db")
    parser.add_argument(
        "--prefill-ceiling",
        type=int,
        default=None,
        help="list iterations with more prefill tokens than this (default: the latest "
        "scheduler_config's chunk_size when > 0)",
    )
    parser.add_argument("--limit", type=int, default=20, help="iterations listed at most")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
