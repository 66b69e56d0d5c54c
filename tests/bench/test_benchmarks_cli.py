"""Every one-off benchmark runs as ``python -m benchmarks.<name>`` from the repository root
with the flags (and defaults) it had as an ``iterserve bench`` subcommand; none is one any
more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli_args import BENCHMARKS, parse_args
from iterserve.cli import build_parser

ROOT = Path(__file__).parents[2]

# Each module run as `python -m` would (its `__main__` block) with --help, in one process.
_HELP_ALL = """
import runpy, sys
for name in {names!r}:
    sys.argv = [name, "--help"]
    try:
        runpy.run_module("benchmarks." + name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        print(name, "exit", e.code)
"""


def test_every_benchmark_runs_as_a_module_with_its_help() -> None:
    names = sorted(BENCHMARKS)
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_ALL.format(names=names)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in names:
        assert f"usage: python -m benchmarks.{name}" in proc.stdout
        assert f"{name} exit 0" in proc.stdout


def test_flags_keep_their_defaults() -> None:
    args = parse_args("decode", [])
    assert (args.model, args.dtype, args.iters, args.output_dir) == ("default", "auto", 10, None)
    assert args.shapes == "1x128,32x128,128x128,64x512"
    args = parse_args("soak", [])
    assert (args.duration, args.config_interval, args.request_rate) == (1800.0, 60.0, 3.0)
    args = parse_args("gpu", [])
    assert (args.device, args.sections, args.copy_mib) == ("cuda", "1,2,3,4,5", 1024)


@pytest.mark.parametrize("name", ["decode", "engine-loop", "messages", "router", "soak", "gpu"])
def test_the_cli_has_no_one_off_benchmark(name: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", name])
