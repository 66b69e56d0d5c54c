"""``iterserve bench fidelity``: the comparisons on synthetic summaries, the trace shapes, and
the whole flow against a simulated replica standing in for the real server."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from iterserve.bench import fidelity
from iterserve.bench.fidelity import main
from iterserve.bench.fidelity_compare import (
    METRICS,
    compare,
    compare_by_tier,
    format_rejections,
    format_rows,
    histogram_quantile,
    queue_buckets,
    queue_ms,
    rejections_by_tier,
    spread,
    verdict,
)
from iterserve.bench.fidelity_shapes import SHAPES, build_trace, parse_shapes, shape_seed
from iterserve.cli import build_parser
from iterserve.models.loader import resolve_model_dir
from iterserve.sim.profile import load_profile
from iterserve.sim.tokenizer import FileTokenizer
from iterserve.workload.stats import RequestRecord
from iterserve.workload.workloads import load_trace


def _summary(tok_s: float, tpot: float, ttft: float, queue: float) -> dict[str, Any]:
    return {
        "output_tokens_per_s": tok_s,
        "tpot_ms": {"p50": tpot, "p99": 2 * tpot},
        "ttft_ms": {"p50": ttft, "p99": 3 * ttft},
        "queue_ms": {"p50": queue, "p99": 4 * queue},
    }


def test_compare_ratios_spread_and_verdicts() -> None:
    sim = _summary(tok_s=100.0, tpot=60.0, ttft=130.0, queue=10.0)
    real = [_summary(100.0, 40.0, 100.0, 5.0), _summary(100.0, 60.0, 100.0, 15.0)]
    rows = {r["metric"]: r for r in compare(sim, real)}
    assert list(rows) == [name for name, _, _ in METRICS]

    assert rows["output tok/s"]["ratio"] == 1.0 and rows["output tok/s"]["verdict"] == "ok"
    assert rows["output tok/s"]["real_spread"] == 0.0
    # TPOT p50: 60 against a mean of 50 (1.2, over 15%) but the replays span 40-60 (50%).
    tpot = rows["TPOT p50"]
    assert tpot["measured"] == 50.0 and tpot["measured_runs"] == [40.0, 60.0]
    assert tpot["ratio"] == pytest.approx(1.2) and tpot["real_spread"] == pytest.approx(0.5)
    assert tpot["verdict"] == "noise"
    # TTFT p50: 1.3 is outside 30% by a hair and the replays agree exactly: a miss.
    assert rows["TTFT p50"]["ratio"] == pytest.approx(1.3)
    assert rows["TTFT p99"]["verdict"] == verdict(1.3, 0.30, 0.0)
    # No target: reported, no verdict.
    assert rows["queue p99"]["tolerance"] is None and rows["queue p99"]["verdict"] == "-"
    assert rows["queue p50"]["ratio"] == pytest.approx(1.0)


def test_verdict_and_spread_edges() -> None:
    assert verdict(1.1, 0.15, math.nan) == "ok"
    assert verdict(0.5, 0.15, math.nan) == "miss"  # one replay: no spread to explain it
    assert verdict(0.5, 0.15, 0.6) == "noise"
    assert verdict(math.nan, 0.15, 0.0) == "-"
    assert math.isnan(spread([3.0])) and math.isnan(spread([3.0, math.nan]))
    assert spread([0.0, 0.0]) == 0.0 and spread([0.0, 1.0]) == math.inf
    with pytest.raises(ValueError, match="at least one real replay"):
        compare(_summary(1, 1, 1, 1), [])


def test_compare_by_tier_covers_tiers_of_either_side() -> None:
    sim = {"premium": _summary(10, 50, 100, 1)}
    real = [{"standard": _summary(10, 50, 100, 1)}, {"premium": _summary(10, 50, 100, 1)}]
    by_tier = compare_by_tier(sim, real)
    assert set(by_tier) == {"premium", "standard"}
    # standard: never simulated: NaN ratios, no verdict.
    assert all(math.isnan(r["ratio"]) and r["verdict"] == "-" for r in by_tier["standard"])
    premium = {r["metric"]: r for r in by_tier["premium"]}
    assert math.isnan(premium["TTFT p50"]["measured_runs"][0])  # not in the first replay
    assert premium["TTFT p50"]["measured"] == 100.0


def _scrape(observations: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    h = Histogram(
        "iterserve_request_queue_time_seconds",
        "Arrival to first admission",
        ["tier"],
        buckets=(0.1, 0.2, 0.4, 1.0),
        registry=registry,
    )
    for tier, values in observations.items():
        for v in values:
            h.labels(tier=tier).observe(v)
    return generate_latest(registry).decode()


def test_queue_quantiles_from_two_scrapes() -> None:
    before = queue_buckets(_scrape({"standard": [0.05] * 10}))
    # Between the scrapes: 10 more at 0.15 s (bucket 0.1-0.2) for standard, 4 at 5 s premium.
    after = queue_buckets(_scrape({"standard": [0.05] * 10 + [0.15] * 10, "premium": [5.0] * 4}))
    assert after["standard"][math.inf] == 20 and after["premium"][0.1] == 0
    standard = queue_ms(before, after, ["standard"])
    assert standard["count"] == 10
    # All 10 new observations in (0.1, 0.2]: the median interpolates to 150 ms.
    assert standard["p50"] == pytest.approx(150.0) and standard["p99"] == pytest.approx(199.0)
    # premium's are past the last finite bound: Prometheus answers that bound.
    assert queue_ms(before, after, ["premium"])["p50"] == pytest.approx(1000.0)
    assert queue_ms(before, after)["count"] == 14
    assert math.isnan(queue_ms(after, after)["p50"])
    assert histogram_quantile(0.5, {0.1: 2, 0.2: 2, math.inf: 2}) == pytest.approx(0.05)


def test_rejections_and_formatting() -> None:
    records = [
        RequestRecord(ok=False, tier="premium", status=429),
        RequestRecord(ok=False, tier="premium", status=429),
        RequestRecord(ok=False, tier="standard", status=400),
        RequestRecord(ok=True, tier="standard", status=200),
    ]
    assert rejections_by_tier(records) == {"premium": 2}
    line = format_rejections([{"premium": 2}, {}], {"premium": 1, "standard": 3})
    assert line == "  429s per tier: premium real 2/0 sim 1, standard real 0/0 sim 3"
    assert format_rejections([{}], {}) == "  429s: none (real and simulated)"
    rows = compare(
        _summary(100, 60, 130, 10), [_summary(100, 40, 100, 5), _summary(100, 60, 100, 15)]
    )
    lines = format_rows(rows)
    assert len(lines) == 1 + len(METRICS)
    assert "TPOT p50" in lines[2] and lines[2].rstrip().endswith("noise") and "50%" in lines[2]
    assert lines[1].rstrip().endswith("ok") and lines[-1].rstrip().endswith("-")


def test_parse_shapes() -> None:
    assert [s.name for s in parse_shapes("all")] == list(SHAPES)
    # A shape's seed does not depend on which others are selected.
    assert shape_seed(parse_shapes("tiers")[0], 7) == shape_seed(SHAPES["tiers"], 7) == 507
    assert len({shape_seed(s, 0) for s in SHAPES.values()}) == len(SHAPES)
    assert [s.name for s in parse_shapes("tiers, bursty")] == ["tiers", "bursty"]
    for bad, message in (
        ("poisson", "unknown shape"),
        ("", "none given"),
        ("tiers,tiers", "twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_shapes(bad)


def test_traces_of_the_shapes() -> None:
    tokenizer = FileTokenizer(resolve_model_dir("default"))
    profile = load_profile("cpu-smollm2")
    kwargs = {"model": str(resolve_model_dir("default"))}
    bursty = build_trace(SHAPES["bursty"], tokenizer, profile, kwargs, 20, 0, 16)
    arrivals = [r.arrival_s for r in bursty.requests]
    # Groups of 8 at once, one group every 8 / rate seconds: a mean rate of 0.8x capacity.
    assert arrivals[:8] == [0.0] * 8 and len(set(arrivals)) == 3
    assert arrivals[8] == pytest.approx(8 / bursty.rate)
    assert bursty.rate == pytest.approx(0.8 * bursty.simulated_capacity_rps)
    tiers = build_trace(SHAPES["tiers"], tokenizer, profile, kwargs, 20, 0, 16)
    assert {r.priority for r in tiers.requests} <= {"premium", "standard", "best-effort"}
    assert len({r.priority for r in tiers.requests}) > 1
    assert SHAPES["tiers"].engine_kwargs(kwargs)["tiers"][0]["max_queue_wait_ms"] > 0
    shared = build_trace(SHAPES["shared-prefix"], tokenizer, profile, kwargs, 20, 0, 16)
    prefixes = {r.prompt.split("\n\n")[0] for r in shared.requests}
    assert len(prefixes) == 4  # num_prefixes of the shape
    poisson = build_trace(SHAPES["poisson-high"], tokenizer, profile, kwargs, 20, 0, 16)
    gaps = {b.arrival_s - a.arrival_s for a, b in itertools.pairwise(poisson.requests)}
    assert len(gaps) == 19  # exponential gaps, all distinct


def _run(tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    args = build_parser().parse_args(["bench", "fidelity", "--output-dir", str(tmp_path), *flags])
    status = main(args)
    (path,) = tmp_path.glob("fidelity-*/fidelity.json")
    return status, json.loads(path.read_text())


# Stands in for ``bench calibrate`` (90 s even at --smoke on 2 loaded cores): writes the
# built-in profile, renamed, where --out says, and records its command line.
FAKE_CALIBRATE = """
import json, sys
from pathlib import Path
from iterserve.sim.profile import load_profile
argv = sys.argv[1:]
out = Path(argv[argv.index("--out") + 1])
Path(sys.argv[0]).with_suffix(".argv").write_text(json.dumps(argv))
profile = json.loads(load_profile("cpu-smollm2").to_json())
profile["name"] = "calibrated-here"
out.write_text(json.dumps(profile))
print("fake calibration: wrote", out)
"""


def test_flow_against_a_simulated_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibrate (a stand-in), then one shape (tiers), 6 requests, 2 real replays through
    ``serve --simulate``: the JSON has every ratio per shape and per tier, beside the
    replays' spread, and the 429s."""
    script = tmp_path / "calibrate.py"
    script.write_text(FAKE_CALIBRATE)
    monkeypatch.setattr(fidelity, "_calibrate_command", lambda: [sys.executable, str(script)])
    status, result = _run(
        tmp_path, "--shapes", "tiers", "--num-requests", "6", "--max-output-len", "8",
        "--calibrate-args=--smoke", "--server-args", "--simulate cpu-smollm2",
    )  # fmt: skip
    assert status == 0, result.get("error")
    # The profile the calibration wrote is the one the simulator used.
    run_dir = next(tmp_path.glob("fidelity-*"))
    assert result["profile"] == str(run_dir / "profile.json")
    assert load_profile(result["profile"]).name == "calibrated-here"
    argv = json.loads(script.with_suffix(".argv").read_text())
    assert argv[-1] == "--smoke" and argv[argv.index("--output-dir") + 1].endswith("calibrate")
    assert result["shapes"] == ["tiers"] and result["repeat_real"] == 2
    (run,) = result["runs"]
    assert run["shape"] == "tiers" and run["num_requests"] == 6 and len(run["measured"]) == 2
    metrics = [name for name, _, _ in METRICS]
    assert [row["metric"] for row in run["comparison"]] == metrics
    for row in run["comparison"]:
        assert len(row["measured_runs"]) == 2
        assert row["verdict"] in {"ok", "noise", "miss", "-"}
    throughput = run["comparison"][0]
    assert throughput["measured"] > 0 and throughput["simulated"] > 0
    assert throughput["ratio"] == pytest.approx(throughput["simulated"] / throughput["measured"])
    # Every tier sent, on both sides, with every metric.
    tiers = {t for r in run["measured"] for t in r["by_tier"]}
    assert tiers and tiers <= {"premium", "standard", "best-effort"}
    assert set(run["comparison_by_tier"]) == tiers | set(run["simulated"]["by_tier"])
    for rows in run["comparison_by_tier"].values():
        assert [row["metric"] for row in rows] == metrics
    # The real server's queue times come from its histogram: one per request it admitted.
    for replay in run["measured"]:
        admitted = replay["summary"]["num_requests"] - sum(replay["rejected_429"].values())
        assert replay["summary"]["queue_ms"]["count"] == admitted
        assert replay["iterations"] > 0
    assert isinstance(run["simulated"]["rejected_429"], dict)
    out = capsys.readouterr().out
    assert "tiers: 6 mixed requests" in out
    assert any(f"tier {t}:" in out for t in tiers) or len(run["comparison_by_tier"]) == 1
    assert "429s" in out and "fake calibration: wrote" in out
    assert (run_dir / "fidelity.png").stat().st_size > 1000
    assert (run_dir / "trace-tiers.jsonl").read_text().count("\n") == 6
    assert "best-effort" in (run_dir / "tiers.yaml").read_text()


def test_a_refused_calibration_stops_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, result = _run(tmp_path, "--shapes", "bursty", "--calibrate-args=--no-such-flag")
    assert status == 1
    assert "bench calibrate exited with 2" in result["error"]
    assert "unrecognized arguments: --no-such-flag" in result["error"]
    assert "runs" not in result
    assert "stopped: bench calibrate exited with 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shapes", "nope"], "unknown shape(s) nope"),
        (["--repeat-real", "0"], "--repeat-real must be >= 1"),
        (["--num-requests", "0"], "--num-requests must be >= 1"),
        (["--no-calibrate"], "--no-calibrate needs --profile"),
        (["--profile", "cpu-smollm2"], "--profile is for --no-calibrate"),
        (["--server-args", "'unclosed"], "--server-args: No closing quotation"),
    ],
)
def test_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    args = build_parser().parse_args(["bench", "fidelity", "--output-dir", str(tmp_path), *flags])
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written for a refused command line


@pytest.mark.model
def test_smoke_on_the_real_model(tmp_path: Path) -> None:
    """The flow on the default model at tiny sizes: one shape replayed twice through the real
    server and once simulated (the built-in profile: a smoke calibration alone takes 7-90 s
    here depending on the load; the calibration step is the stand-in test's)."""
    status, result = _run(
        tmp_path, "--shapes", "poisson-high", "--num-requests", "4", "--max-output-len", "8",
        "--no-calibrate", "--profile", "cpu-smollm2",
    )  # fmt: skip
    assert status == 0, result.get("error")
    run_dir = next(tmp_path.glob("fidelity-*"))
    assert result["profile"] == "cpu-smollm2" and "calibration" not in result
    (run,) = result["runs"]
    assert [row["metric"] for row in run["comparison"]] == [name for name, _, _ in METRICS]
    trace = load_trace(run_dir / "trace-poisson-high.jsonl")
    expected_tokens = sum(r.output_len for r in trace)
    for replay in run["measured"]:
        summary = replay["summary"]
        # Every request whole: ignore_eos with min_tokens = max_tokens, as the trace says.
        assert summary["num_ok"] == 4 and summary["output_tokens"] == expected_tokens
        assert replay["server_cpu_cores"]["engine"] > 0  # the model ran in its own process
    assert run["simulated"]["summary"]["output_tokens"] == expected_tokens
    assert all(len(row["measured_runs"]) == 2 for row in run["comparison"])


SERVER_UNDER_SIGTERM = """
import sys, time
from pathlib import Path
from iterserve.bench.fidelity_real import real_server, warm_up
with real_server(0, ["--simulate", "cpu-smollm2"], Path(sys.argv[1])) as (url, pid):
    warm_up(url)  # our client sends no key: the server must not expect one
    print(pid, flush=True)
    time.sleep(120)
"""


def test_sigterm_stops_the_real_server_too(tmp_path: Path) -> None:
    """A calibration or fidelity run ended by SIGTERM (a CI timeout, ``kill``) stops the
    server it started, as Ctrl-C does (it was left running before); and a server started
    under ``ITERSERVE_API_KEY`` serves the keyless client (it refused it before)."""
    script = tmp_path / "hold.py"
    script.write_text(SERVER_UNDER_SIGTERM)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ITERSERVE_API_KEY": "a-key-our-client-does-not-send"},
    )
    assert proc.stdout is not None
    server_pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (
        not Path(f"/proc/{server_pid}").exists()
        or "Z" in Path(f"/proc/{server_pid}/stat").read_text().split(")")[1][:3]
    )
