"""The one-off benchmarks of ``benchmarks/`` (decode, engine loop, messages, telemetry) run end
to end at smoke size (their ``main``; messages as ``python -m benchmarks.messages`` from the
repository root) and write their table, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli_args import parse_args
from iterserve.bench.roofline import DecodeRow, format_table

ROOT = Path(__file__).parents[2]  # `python -m benchmarks.<name>` runs from the checkout


@pytest.mark.model
def test_smoke_run_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.decode import main

    assert main(parse_args("decode", ["--smoke", "--output-dir", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert "x linears" in out and "x floor" in out
    data = json.loads((tmp_path / "decode.json").read_text())
    assert [(r["batch"], r["context"]) for r in data["rows"]] == [(1, 16), (4, 32)]
    for row in data["rows"]:
        assert row["iteration_ms"] > 0 and row["linears_ms"] > 0 and row["floor_ms"] > 0
        assert row["kv_bytes"] == row["batch"] * row["context"] * 30 * 2 * 3 * 64 * 2
    assert data["meta"]["copy_bandwidth_gb_s"] > 0
    assert (tmp_path / "decode.png").stat().st_size > 1000


def test_table_ratios() -> None:
    row = DecodeRow(
        32, 128, iteration_ms=30.0, linears_ms=20.0, floor_ms=10.0, weight_bytes=1, kv_bytes=2
    )
    assert (row.vs_linears, row.vs_floor) == (1.5, 3.0)
    assert "1.50" in format_table([row]) and "3.00" in format_table([row])


@pytest.mark.model
def test_engine_loop_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.engine_loop import main

    assert main(parse_args("engine_loop", ["--smoke", "--output-dir", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert "thread / process throughput" in out
    rows = json.loads((tmp_path / "engine_loop.json").read_text())
    assert [r["mode"] for r in rows] == ["thread", "process"]
    assert all(r["output_tokens"] == 2 * 4 for r in rows)


def test_messages_bench_shows_constant_bytes_per_token_for_deltas(tmp_path: Path) -> None:
    """Bytes are deterministic (not timings): deltas stay flat, cumulative outputs grow."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.messages", "--smoke", "--logprobs",
         "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    assert "cumulative" in proc.stdout
    data = json.loads((tmp_path / "messages.json").read_text())
    short, long = data["rows"]
    assert (short["output_len"], long["output_len"]) == (16, 64)
    assert short["num_tokens"] == 8 * 16 and long["num_tokens"] == 8 * 64
    assert long["delta_bytes_per_token"] == pytest.approx(short["delta_bytes_per_token"], rel=0.02)
    assert long["cumulative_bytes_per_token"] > 1.5 * short["cumulative_bytes_per_token"]
    assert long["delta_bytes_per_token"] < long["cumulative_bytes_per_token"] / 3
    assert (tmp_path / "messages.png").stat().st_size > 1000


def test_telemetry_bench_smoke(tmp_path: Path) -> None:
    """Both modes run the same iterations; only ``on`` writes rows, one per iteration."""
    from benchmarks.telemetry import main

    assert main(parse_args("telemetry", ["--smoke", "--output-dir", str(tmp_path)])) == 0
    data = json.loads((tmp_path / "telemetry.json").read_text())
    (off,), (on,) = data["off"]["runs"], data["on"]["runs"]
    assert off["iterations"] == on["iterations"] > 0
    assert (off["rows_written"], on["rows_written"]) == (0, on["iterations"])
    assert on["rows_dropped"] == 0 and on["record_us_per_iteration"] > 0
    assert data["on_over_off"] > 0
