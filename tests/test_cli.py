"""The ``iterserve`` command builds its parser, and prints every --help, without heavy imports."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from iterserve import __version__
from iterserve.cli import build_parser, main

# Nothing of these may load before a subcommand runs (torch alone takes ~1.5 s to import).
HEAVY_MODULES = (
    "torch",
    "transformers",
    "numpy",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "pytest",
    "hypothesis",
)

# In a fresh interpreter: build the parser, format the help of every (sub)command, and report
# the commands seen and which heavy modules got imported.
_PROBE = f"""
import argparse, json, sys
from iterserve.cli import build_parser

def walk(parser, path):
    parser.format_help()
    yield " ".join(path)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, [*path, name])

commands = list(walk(build_parser(), []))
heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]
print(json.dumps({{"commands": commands, "heavy": heavy}}))
"""

COMMANDS = [
    "",
    "serve",
    "generate",
    "router",
    "router envoy-config",
    "operator",
    "operator run",
    "operator render",
    "simulate",
    "report",
    "bench",
    "bench offline",
    "bench serve",
    "bench gate",
    "bench calibrate",
    "bench fidelity",
    "bench quantization",
]


def test_parser_and_help_import_nothing_heavy() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True
    )
    report = json.loads(proc.stdout)
    assert report["commands"] == COMMANDS  # every subcommand was built and formatted
    assert report["heavy"] == []


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_exits_zero(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: iterserve {command}".rstrip())


def test_bench_flags_keep_their_defaults() -> None:
    """Spot checks: the flags moved out of the bench modules with their defaults."""
    args = build_parser().parse_args(["bench", "calibrate"])
    assert (args.model, args.dtype, args.seed, args.output_dir) == ("default", "auto", 0, None)
    args = build_parser().parse_args(["bench", "gate", "a.json", "b.json"])
    assert (args.max_ttft_p99_regression, args.max_tpot_p50_regression) == (0.20, 0.15)
    args = build_parser().parse_args(["bench", "serve"])
    assert (args.workload, args.request_rate, args.timeout_s) == ("mixed", float("inf"), 1800.0)


def test_operator_run_flags_the_chart_passes() -> None:
    """The flags charts/iterserve's Deployment passes parse, with the documented defaults."""
    args = build_parser().parse_args(["operator", "run"])
    assert (args.namespace, args.log_level, args.liveness_port) == ([], "info", 8081)
    assert (args.resync_interval_s, args.push_timeout_s) == (10.0, 5.0)
    assert args.control_image == f"ghcr.io/iterserve/iterserve:{__version__}-control"
    args = build_parser().parse_args(
        ["operator", "run", "--namespace", "a", "--namespace", "b", "--log-level", "debug",
         "--control-image", "img:1", "--resync-interval-s", "30", "--push-timeout-s", "2"]
    )  # fmt: skip
    assert (args.namespace, args.log_level, args.control_image) == (["a", "b"], "debug", "img:1")
    assert (args.resync_interval_s, args.push_timeout_s) == (30.0, 2.0)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["operator", "run", "--log-level", "verbose"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "ports",
    [["--metrics-port", "8081"], ["--liveness-port", "8082"], ["--metrics-port", "-1"],
     ["--liveness-port", "70000"]],
)  # fmt: skip
def test_operator_run_refuses_clashing_or_impossible_ports(
    ports: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Breaker finding: --metrics-port == --liveness-port started, and kopf's liveness endpoint
    # then failed to bind (a crash loop with a bare OSError); -1 was an OverflowError.
    import kopf

    from iterserve.operator import main as operator_main
    from iterserve.operator.metrics import OperatorMetrics

    started: list[str] = []
    monkeypatch.setattr(kopf, "run", lambda **_: started.append("kopf"))
    monkeypatch.setattr(OperatorMetrics, "serve", lambda *_: started.append("metrics"))
    try:
        code = operator_main.main(build_parser().parse_args(["operator", "run", *ports]))
    except SystemExit as e:
        code = e.code
    assert (code, started) == (2, [])
    assert "port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("level", "expected"),
    [("debug", logging.DEBUG), ("info", logging.INFO), ("warning", logging.WARNING),
     ("error", logging.ERROR)],
)  # fmt: skip
def test_operator_log_level_sets_the_root_logger(level: str, expected: int) -> None:
    from iterserve.operator.main import configure_logging

    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        configure_logging(level)
        assert root.level == expected
    finally:
        root.setLevel(before[0])
        root.handlers[:] = before[1]
