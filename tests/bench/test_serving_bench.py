"""The serving benchmark: statistics and the gate on recorded data, workloads, and a smoke
run of ``bench serve`` and ``bench gate`` against a real server."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_utils import run_server
from transformers import AutoTokenizer

from iterserve.bench.serve import _body, arrival_times
from iterserve.models.loader import resolve_model_dir
from iterserve.workload.stats import (
    SLO,
    RequestRecord,
    cost_per_million_tokens,
    gate,
    percentile,
    summarize,
    summarize_by_tier,
)
from iterserve.workload.workloads import load_trace, make_workload, save_trace

RECORDS = [
    RequestRecord(ok=True, output_tokens=11, ttft_s=0.1, e2e_s=1.1, itl_s=[0.1] * 10, tier="a"),
    RequestRecord(ok=True, output_tokens=5, ttft_s=0.5, e2e_s=1.3, itl_s=[0.2] * 4, tier="b"),
    RequestRecord(ok=True, output_tokens=1, ttft_s=3.0, e2e_s=3.0, tier="b"),
    RequestRecord(ok=False, error="429", status=429, tier="a"),
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.exponential(size=n).tolist()
        for p in (0, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(np.percentile(values, p))
    assert math.isnan(percentile([], 50))


def test_summary_on_recorded_data() -> None:
    s = summarize(RECORDS, duration_s=4.0, slo=SLO(ttft_ms=1000, tpot_ms=150))
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (4, 3, 1)
    assert s["output_tokens"] == 17 and s["output_tokens_per_s"] == pytest.approx(17 / 4)
    assert s["requests_per_s"] == pytest.approx(3 / 4)
    # TPOT: (1.1 - 0.1) / 10 = 100 ms meets 150; (1.3 - 0.5) / 4 = 200 ms does not;
    # the third has one token (no TPOT) but a 3 s TTFT; the fourth failed.
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 4)
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # 10 gaps of 100 ms, 4 of 200 ms
    by_tier = summarize_by_tier(RECORDS, 4.0, SLO())
    assert by_tier["a"]["num_failed"] == 1 and by_tier["b"]["num_ok"] == 2


def test_cost_per_million_tokens() -> None:
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert math.isinf(cost_per_million_tokens(3.6, 0.0))


def test_gate_thresholds() -> None:
    base = {"ttft_ms": {"p99": 100.0}, "tpot_ms": {"p50": 50.0}}
    ok = {"ttft_ms": {"p99": 119.0}, "tpot_ms": {"p50": 57.0}}
    slow = {"ttft_ms": {"p99": 121.0}, "tpot_ms": {"p50": 50.0}}
    assert all(r.passed for r in gate(base, ok))
    assert [r.passed for r in gate(base, slow)] == [False, True]
    assert all(r.passed for r in gate(base, slow, max_ttft_p99_regression=0.25))


def test_gate_command_exit_codes(tmp_path: Path) -> None:
    def write(name: str, ttft: float, tpot: float) -> Path:
        path = tmp_path / name
        path.write_text(
            json.dumps({"summary": {"ttft_ms": {"p99": ttft}, "tpot_ms": {"p50": tpot}}})
        )
        return path

    base, good, bad = write("b.json", 100, 50), write("g.json", 90, 55), write("x.json", 100, 60)
    cmd = [sys.executable, "-m", "iterserve.cli", "bench", "gate"]
    assert subprocess.run([*cmd, str(base), str(good)], capture_output=True).returncode == 0
    out = subprocess.run([*cmd, str(base), str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "REGRESSED" in out.stdout and "tpot_ms.p50" in out.stdout


def test_mixed_workload_distribution(tokenizer: Any) -> None:
    requests = make_workload("mixed", tokenizer, 64, seed=3)
    assert requests == make_workload("mixed", tokenizer, 64, seed=3)  # seeded
    assert requests != make_workload("mixed", tokenizer, 64, seed=4)
    lengths = [r.prompt_len for r in requests]
    assert all(16 <= n <= 1024 for n in lengths)
    assert 100 <= float(np.median(lengths)) <= 400  # median 200 in expectation
    outputs = [r.output_len for r in requests]
    assert all(8 <= n <= 512 for n in outputs)
    assert sum(n <= 48 for n in outputs) > 16 and any(n > 192 for n in outputs)
    for r in requests[:8]:  # real text, about as many tokens as cut
        assert len(tokenizer(r.prompt).input_ids) == pytest.approx(r.prompt_len, abs=3)
        assert sum(c.isalpha() for c in r.prompt) > r.prompt_len // 2


def test_long_prompt_and_shared_prefix_workloads(tokenizer: Any) -> None:
    long = make_workload("long-prompt", tokenizer, 20)
    assert [r.prompt_len >= 3000 for r in long] == [i % 10 == 0 for i in range(20)]
    assert all(100 <= r.prompt_len <= 300 for i, r in enumerate(long) if i % 10)
    shared = make_workload("shared-prefix", tokenizer, 6)
    prefix = os.path.commonprefix([r.prompt for r in shared])  # noqa: RUF071 (strings)
    assert len(tokenizer(prefix).input_ids) >= 490
    assert all(550 <= r.prompt_len <= 700 for r in shared)


def test_shared_prefix_with_many_prefixes(tokenizer: Any) -> None:
    one = make_workload("shared-prefix", tokenizer, 40, seed=5)
    assert make_workload("shared-prefix", tokenizer, 40, seed=5, num_prefixes=1) == one
    many = make_workload("shared-prefix", tokenizer, 40, seed=5, num_prefixes=4)
    assert many == make_workload("shared-prefix", tokenizer, 40, seed=5, num_prefixes=4)
    groups: dict[str, list[str]] = {}  # by the first 100 characters: the system prompt
    for r in many:
        groups.setdefault(r.prompt[:100], []).append(r.prompt)
    assert len({r.prompt[:100] for r in one}) == 1
    assert len(groups) == 4  # 40 uniform draws over 4: every one drawn (seeded)
    for prompts in groups.values():
        assert len(prompts) >= 2
        prefix = os.path.commonprefix(prompts)  # noqa: RUF071 (strings)
        assert len(tokenizer(prefix).input_ids) == pytest.approx(500, abs=10)
    assert all(550 <= r.prompt_len <= 700 for r in many)
    for bad, name in ((0, "shared-prefix"), (2, "mixed")):
        with pytest.raises(ValueError, match="num_prefixes must be >= 1"):
            make_workload(name, tokenizer, 4, num_prefixes=bad)


def test_trace_round_trip(tmp_path: Path, tokenizer: Any) -> None:
    requests = make_workload("mixed", tokenizer, 5, max_output_len=20)
    path = tmp_path / "trace.jsonl"
    save_trace(requests, path)
    assert load_trace(path) == requests
    path.write_text('{"timestamp": 1.5, "prompt": "hi", "max_tokens": 3, "priority": "premium"}\n')
    (r,) = load_trace(path)
    assert (r.arrival_s, r.output_len, r.priority) == (1.5, 3, "premium")
    path.write_text('{"prompt": "no max_tokens"}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        load_trace(path)
    # The trace format's optional fields: chat messages, min_tokens, tenant, a length-only entry.
    path.write_text(
        '{"timestamp": 0, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
        '"min_tokens": 2, "tenant": "acme"}\n{"timestamp": 1, "prompt_len": 300, "max_tokens": 8}\n'
    )
    chat, sized = load_trace(path)
    assert chat.messages == [{"role": "user", "content": "hi"}] and chat.prompt == ""
    assert (chat.min_tokens, chat.tenant) == (2, "acme")
    body = _body(chat, "m", "completions", plain=False)
    assert body["messages"] == chat.messages and body["user"] == "acme"
    assert body["min_tokens"] == 2 and "prompt" not in body
    assert (sized.prompt, sized.prompt_len) == ("", 300)


def test_a_saved_trace_carries_the_open_loop_arrivals(tmp_path: Path, tokenizer: Any) -> None:
    import argparse

    from iterserve.bench.serve import _with_arrivals

    requests = make_workload("mixed", tokenizer, 6, max_output_len=20)
    args = argparse.Namespace(concurrency=None, burst=None, burst_interval_s=0.0, seed=3)
    timed = _with_arrivals(requests, 2.0, args)
    assert [r.arrival_s for r in timed] == arrival_times(6, 2.0, None, 0.0, 3)
    path = tmp_path / "trace.jsonl"
    save_trace(timed, path)
    assert load_trace(path) == timed


def test_arrivals_and_plain_bodies(tokenizer: Any) -> None:
    times = arrival_times(2000, rate=4.0, burst=None, burst_interval_s=0, seed=0)
    assert times == sorted(times) and times[-1] / 2000 == pytest.approx(0.25, rel=0.1)
    assert arrival_times(5, math.inf, None, 0, 0) == [0.0] * 5
    assert arrival_times(5, 1.0, 2, 10.0, 0) == [0, 0, 10, 10, 20]
    (req,) = make_workload("mixed", tokenizer, 1)
    plain = _body(req, "m", "chat", plain=True)
    assert set(plain) == {
        "model",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "messages",
    }
    ours = _body(req, "m", "completions", plain=False)
    assert ours["ignore_eos"] and ours["min_tokens"] == ours["max_tokens"] == req.output_len


def test_bench_serve_smoke_and_gate_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``iterserve bench serve`` over HTTP against a real server (in this process: the
    command's own main, as the CLI runs it), then ``bench gate`` on its JSON. The server is
    a simulated replica (the real HTTP server and scheduler over the default model's
    calibrated latency profile, 4x faster): what is measured here is the client, not the
    model."""
    from iterserve.cli import main

    flags = ("--simulate", "cpu-smollm2", "--simulate-speed", "4", "--max-num-seqs", "8")
    with run_server(*flags) as server:
        cmd = ["bench", "serve", "--url", server.url, "--smoke", "--no-progress", "--output-dir"]
        tiers = ["--tier-mix", "premium=1,best-effort=1", "--cost-per-hour", "2.0"]
        assert main([*cmd, str(tmp_path / "one"), *tiers]) == 0
        out = capsys.readouterr().out
        assert "TTFT p99" in out and "per 1M output tokens" in out
        # 8 requests at 16 req/s arrive within about half a second, then all at once.
        sweep = ["--sweep", "16,inf", "--endpoint", "chat", "--plain"]
        assert main([*cmd, str(tmp_path / "two"), *sweep]) == 0
        assert "highest rate meeting the SLO" in capsys.readouterr().out
    results = [*tmp_path.glob("one/serve-*.json"), *tmp_path.glob("two/serve-*.json")]
    assert len(results) == 2 and len(list(tmp_path.glob("*/serve-*.png"))) == 2
    first = json.loads(results[0].read_text())
    run = first["runs"][0]
    assert run["summary"]["num_ok"] == 8 and 8 * 8 <= run["summary"]["output_tokens"] <= 8 * 16
    assert set(run["by_tier"]) == {"premium", "best-effort"}
    assert run["summary"]["ttft_ms"]["p50"] > 0 and run["client_cpu_s"] >= 0
    second = json.loads(results[1].read_text())
    assert [r["rate"] for r in second["runs"]] == [16.0, None]
    # The gate reads the recorded result's summary: candidates derived from it by a known
    # factor pass within the limits (+20% p99 TTFT, +15% p50 TPOT) and fail beyond.
    assert first["summary"]["ttft_ms"]["p99"] > 0 and first["summary"]["tpot_ms"]["p50"] > 0

    def candidate(name: str, ttft_factor: float, tpot_factor: float) -> Path:
        data = json.loads(results[0].read_text())
        data["summary"]["ttft_ms"]["p99"] *= ttft_factor
        data["summary"]["tpot_ms"]["p50"] *= tpot_factor
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    gate = ["bench", "gate", str(results[0])]
    assert main([*gate, str(candidate("within.json", 1.1, 1.1))]) == 0
    assert "gate: passed" in capsys.readouterr().out
    assert main([*gate, str(candidate("regressed.json", 1.5, 1.0))]) == 1
    assert "gate: FAILED (ttft_ms.p99)" in capsys.readouterr().out


@pytest.mark.model
def test_bench_offline_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from iterserve.cli import main

    # No roofline: it is run_decode_bench on the smoke's shapes, which
    # tests/bench/test_bench_smoke.py runs end to end through benchmarks.decode.
    argv = ["bench", "offline", "--smoke", "--no-roofline", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "target row 1 >= 10x row 4" in out and "x floor" not in out
    data = json.loads((tmp_path / "offline-smoke.json").read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    # Every engine produced exactly the workload's output tokens.
    assert len({r["output_tokens"] for r in rows.values()}) == 1
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert data["roofline"] == []
    assert (tmp_path / "offline-smoke.png").stat().st_size > 1000
