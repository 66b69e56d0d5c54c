"""``python -m benchmarks.router_kv --smoke``: three runs (no affinity, hash affinity, KV events)
over simulated replicas publishing KV events; a JSON with finite numbers and a plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from server_utils import free_port

from benchmarks.cli_args import parse_args
from benchmarks.router_kv import main


def test_smoke_run_writes_three_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--smoke", "--output-dir", str(tmp_path), "--base-port", str(free_port())]
    argv += ["--kv-events-port", str(free_port())]
    assert main(parse_args("router_kv", argv)) == 0
    (json_path,) = tmp_path.glob("router-kv-*/router_kv.json")
    data = json.loads(json_path.read_text())
    assert (data["num_prefixes"], data["num_kv_blocks"]) == (2, 500)
    runs = data["runs"]
    assert list(runs) == ["no affinity", "hash affinity", "KV events"]
    for run in runs.values():
        assert run["num_ok"] == run["num_requests"] == 10
        assert all(
            math.isfinite(run[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")
        )
        assert 0 < run["prefix_hit_rate"] < 1  # 2 system prompts, 10 requests: later ones hit
    assert runs["no affinity"]["picks_by_reason"].get("least_kv", 0) == 10
    assert (json_path.parent / "router_kv.png").stat().st_size > 1000
    assert "KV-event placement" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prefixes", "0"], "num_prefixes must be >= 1"),
        (["--num-kv-blocks", "-1"], "--num-kv-blocks must be >= 0"),
        (["--num-kv-blocks", "20"], "--num-kv-blocks 20 < "),  # a request needs ~45
    ],
)
def test_bad_flags_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(parse_args("router_kv", ["--output-dir", str(tmp_path), *flags])) == 2
    assert message in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # no run directory, no process started
