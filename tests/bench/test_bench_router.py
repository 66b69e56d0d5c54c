"""``python -m benchmarks.router --smoke`` runs its three parts over simulated replicas and a router
(subprocesses, no model files) and writes a JSON with finite numbers and a plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from server_utils import free_port_block

from benchmarks.cli_args import parse_args
from benchmarks.router import BALANCE_POLICIES, main


def _finite(run: dict[str, float], keys: tuple[str, ...]) -> bool:
    return all(math.isfinite(run[k]) for k in keys)


def test_smoke_run_writes_three_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The replicas on the base port and up, the router after them: 2 replicas in --smoke.
    argv = ["--smoke", "--output-dir", str(tmp_path), "--base-port", str(free_port_block(3))]
    assert main(parse_args("router", argv)) == 0
    (json_path,) = tmp_path.glob("router-*/router.json")
    data = json.loads(json_path.read_text())

    overhead = data["overhead"]
    latency = ("idle_ttft_p50_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    assert _finite(overhead["added_ms"], (*latency, "paired_ttft_p50_ms", "paired_ttft_p90_ms"))
    for mode in ("direct", "router"):
        assert overhead[mode]["num_ok"] == overhead[mode]["num_requests"] == 6
        assert _finite(overhead[mode], latency)
    assert 0 < overhead["router_cpu_s_per_request"] < 1

    headline = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")
    balance = data["balance"]
    assert list(balance["policies"]) == list(BALANCE_POLICIES)
    for run in balance["policies"].values():
        assert run["num_ok"] == run["num_requests"] == 8
        assert _finite(run, (*headline, "simulated_ttft_p99_ms"))
    assert balance["rate_rps"] > 0

    runs = data["affinity"]["runs"]
    assert list(runs) == ["least_kv", "least_kv --no-prefix-affinity"]
    for run in runs.values():
        assert run["num_ok"] == run["num_requests"] == 8
        assert _finite(run, headline)
        assert 0 <= run["prefix_hit_rate"] < 1
    # 2 system prompts of 500 tokens over 8 requests: with affinity, later ones of a group hit.
    assert runs["least_kv"]["prefix_hit_rate"] > 0

    assert (json_path.parent / "router.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "overhead:" in out and "balance:" in out and "affinity:" in out
