"""``python -m benchmarks.soak --smoke`` against a simulated replica it starts: mixed traffic, a
live config change every 0.8 s (the whole cycle, the restore included), every check passes
and the JSON has the figures; the checks fail on a leaked block, a stuck request, RSS growth."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli_args import parse_args
from benchmarks.reliability import Outcome
from benchmarks.soak import CONFIG_CYCLE, main, summarize


def test_smoke_run_passes_its_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--smoke", "--output-dir", str(tmp_path), "--server-args", "--simulate cpu-smollm2"]
    args = parse_args("soak", argv)
    assert main(args) == 0, capsys.readouterr().out
    (json_path,) = tmp_path.glob("soak-*/soak.json")
    data = json.loads(json_path.read_text())

    assert data["passed"] and all(c["passed"] for c in data["checks"])
    changes = data["config_changes"]
    assert len(changes) >= len(CONFIG_CYCLE) + 1  # the cycle, then the restore
    assert [ch["config_version"] for ch in changes] == list(range(2, len(changes) + 2))
    c = data["counts"]
    assert c["sent"] == c["completed"] + c["rejected"] + c["aborted"] + c["failed"]
    assert c["completed"] > 0 and c["aborted"] > 0 and c["stuck"] == 0
    idle = data["idle_load"]
    assert idle["used_blocks"] == idle["num_running"] == idle["num_waiting"] == 0
    rss = data["rss"]
    assert rss["growth_after_warmup_mib"] <= rss["bound_mib"]
    assert (json_path.parent / "soak.png").stat().st_size > 1000


def test_a_run_too_short_for_its_warm_up_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """45 s against the default warm-up (one config cycle, 7 changes 60 s apart: 420 s)
    would measure nothing after it: refused with the flags to change, before any server
    starts."""
    args = parse_args("soak", ["--duration", "45", "--output-dir", str(tmp_path)])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--duration 45 s leaves no time after the warm-up (420 s" in err
    assert "--config-interval" in err and "--warmup-s" in err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def _run(**overrides: Any) -> dict[str, Any]:
    samples = [
        {"t_s": 0.0, "rss_mib": 100.0},
        {"t_s": 200.0, "rss_mib": 120.0},
        {"t_s": 1800.0, "rss_mib": 130.0},
    ]
    run: dict[str, Any] = {
        "outcomes": [Outcome("standard", True, 0.0, kind="completed", status=200, end_s=2.0)],
        "num_stuck": 0,
        "changes": [{"t_s": 60.0, "keys": ["max_num_seqs"], "status": 200}],
        "idle": {"used_blocks": 0, "num_running": 0, "num_waiting": 0, "num_swapped": 0},
        "final": {"rss_mib": 130.0},
        "samples": samples,
    }
    return run | overrides


def _failed(run: dict[str, Any]) -> set[str]:
    args = parse_args("soak", ["--warmup-s", "120"])
    return {c["check"] for c in summarize(run, args)["checks"] if not c["passed"]}


def test_checks_fail_on_leaks_and_stuck_requests() -> None:
    assert _failed(_run()) == set()
    leaked = {"used_blocks": 3, "num_running": 0, "num_waiting": 1, "num_swapped": 0}
    assert _failed(_run(idle=leaked)) == {
        "used KV blocks when idle",
        "running + waiting + swapped when idle",
    }
    assert _failed(_run(num_stuck=1)) == {"requests without an end (stuck)"}
    hung = Outcome("premium", True, 0.0, kind="failed", status=200, error="client timeout")
    assert _failed(_run(outcomes=[hung])) == {
        "requests without an end (stuck)",
        "accepted, not cancelled, not completed",
    }
    reset = Outcome("standard", True, 0.0, ended=True, connection_error=True, error="ReadError")
    assert _failed(_run(outcomes=[reset])) == {"connections closed without an answer"}
    assert _failed(_run(final={"rss_mib": 300.0})) == {"RSS growth after warm-up (MiB)"}
    refused = [{"t_s": 60.0, "keys": ["tiers"], "status": 422}]
    assert _failed(_run(changes=refused)) == {"live config changes answered 200"}
