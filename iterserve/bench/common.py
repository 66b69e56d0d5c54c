"""Helpers every benchmark shares (torch-free)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def warn_if_loaded() -> None:
    """Benchmarks on 2 cores are easily polluted: say so when something else is running."""
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores; timings will be noisy")


def output_dir(args: argparse.Namespace) -> Path:
    if args.output_dir is not None:
        return Path(args.output_dir)
    return Path("bench-results") / "smoke" if args.smoke else Path("bench-results")
