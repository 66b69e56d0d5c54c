"""What-if replay in virtual time: hand-computed timestamps, determinism, admission in the
loop, several replicas, and the ``iterserve simulate`` command's table and JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from sim_profiles import make_profile, write_profile

from iterserve.cli import main
from iterserve.sim.profile import LatencyProfile
from iterserve.sim.replay import replay
from iterserve.sim.tokenizer import CharTokenizer
from iterserve.workload.workloads import BenchRequest, save_trace


def _trace(*entries: tuple[float, int, int]) -> list[BenchRequest]:
    """(arrival s, prompt tokens, max_tokens) each."""
    return [BenchRequest("", n, m, arrival_s=t) for t, n, m in entries]


def _run(trace: list[BenchRequest], **kwargs: Any) -> Any:
    profile = kwargs.pop("profile", make_profile())
    replicas = kwargs.pop("replicas", 1)
    routing = kwargs.pop("routing", "least_kv")
    seed = kwargs.pop("seed", 0)
    concurrency = kwargs.pop("concurrency", None)
    tokenizer = CharTokenizer(profile.model.vocab_size)
    return replay(trace, profile, kwargs, tokenizer, replicas, routing, seed, concurrency)


def test_timestamps_match_a_hand_computed_three_request_trace() -> None:
    # Forward = 10 ms + 1 ms per decode token + 0.1 ms per prefill token (no overhead).
    #   t=0       A (8 prompt tokens, 3 out) arrives; step 1 prefills A: 10.8 ms -> 10.8 ms
    #   t=5 ms    B (4 tokens, 2 out) arrives mid-step; it joins step 2 at 10.8 ms
    #   step 2    A decode + B prefill of 4: 10 + 1 + 0.4 = 11.4 ms -> 22.2 ms
    #   step 3    A decode + B decode: 12 ms -> 34.2 ms (both finish)
    #   t=1 s     C (4 tokens, 1 out) finds the engine idle: prefill 10.4 ms -> 1.0104 s
    result = _run(_trace((0.0, 8, 3), (0.005, 4, 2), (1.0, 4, 1)))
    a, b, c = result.records
    assert a.ttft_s == pytest.approx(0.0108)
    assert a.itl_s == pytest.approx([0.0114, 0.012])
    assert a.e2e_s == pytest.approx(0.0342)
    assert b.ttft_s == pytest.approx(0.0222 - 0.005)
    assert b.itl_s == pytest.approx([0.012])
    assert b.e2e_s == pytest.approx(0.0342 - 0.005)
    assert c.ttft_s == pytest.approx(0.0104) and c.e2e_s == pytest.approx(0.0104)
    assert [r.output_tokens for r in result.records] == [3, 2, 1]
    assert all(r.ok and r.status == 200 for r in result.records)
    assert result.duration_s == pytest.approx(1.0104)
    # Queue time: B waited from 5 ms to its admission at 10.8 ms; A and C not at all.
    assert sorted(q for _, q in result.queue_s) == pytest.approx([0.0, 0.0, 0.0058])
    assert result.num_iterations == 4


def test_engine_overhead_counts_in_virtual_time() -> None:
    data = make_profile().model_dump()
    data["engine_overhead"] = {"fixed_s": 0.002, "per_seq_s": 0.0}
    profile = LatencyProfile.model_validate(data)
    result = _run(_trace((0.0, 8, 2)), profile=profile)
    # Prefill 10.8 + 2 ms, then a decode 11 + 2 ms.
    assert result.records[0].e2e_s == pytest.approx(0.0128 + 0.013)


def test_serving_costs_count_in_virtual_time() -> None:
    # The serving side (calibration's serve stage): a request reaches the engine 5 ms after
    # it is sent, and each iteration carries 1 ms of CPU, 0.5 ms per token it streams and
    # 2 ms per request it prefills (its first chunk).
    data = make_profile().model_dump()
    data["serving"] = {
        "cpu_per_iteration_s": 0.001,
        "cpu_per_token_s": 0.0005,
        "cpu_per_request_s": 0.002,
        "request_latency_s": 0.005,
    }
    profile = LatencyProfile.model_validate(data)
    #   t=0 sent, t=5 ms at the engine; prefill 10.8 ms + 1 + 0.5 + 2 ms -> 19.3 ms
    #   decode 11 ms + 1 + 0.5 ms -> 31.8 ms
    result = _run(_trace((0.0, 8, 2), (1.0, 8, 2)), profile=profile)
    first, second = result.records
    assert first.ttft_s == pytest.approx(0.005 + 0.0143)
    assert first.itl_s == pytest.approx([0.0125])
    assert first.e2e_s == pytest.approx(0.005 + 0.0143 + 0.0125)
    assert second.ttft_s == pytest.approx(first.ttft_s)  # from when it was sent, not reached
    # Queue time counts at the engine's side, as the server's own does: none waited here.
    assert [q for _, q in result.queue_s] == pytest.approx([0.0, 0.0])
    # A closed loop sends the next request when one ends; it too arrives 5 ms later.
    looped = _run(_trace((0.0, 8, 2), (0.0, 8, 2)), profile=profile, concurrency=1)
    assert result.duration_s - 1.0 == pytest.approx(0.0318)
    assert looped.duration_s == pytest.approx(2 * 0.0318)
    assert [r.ttft_s for r in looped.records] == pytest.approx([0.0193, 0.0193])


def _burst(n: int, seed: int = 0) -> list[BenchRequest]:
    return [BenchRequest("", 20 + (i * 37) % 200, 16 + (i * 11) % 64, arrival_s=i * 0.01)
            for i in range(n)]  # fmt: skip


def _comparable(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("wall_s", "speedup_vs_real_time")}


def test_replay_is_deterministic_for_a_seed() -> None:
    from iterserve.workload.stats import SLO

    slo = SLO(500, 50)
    runs = [_run(_burst(60), max_num_seqs=8, seed=s).report("x", slo) for s in (1, 1, 2)]
    assert _comparable(runs[0]) == _comparable(runs[1])
    assert runs[0]["summary"]["num_ok"] == 60


def test_admission_rejects_in_the_loop() -> None:
    # max_waiting 4 with 40 requests in 0.4 s on a replica admitting 2 at a time: 429s.
    result = _run(_burst(40), max_num_seqs=2, max_waiting=4)
    statuses = [r.status for r in result.records]
    assert result.rejected.get("queue_full", 0) == statuses.count(429) > 0
    assert statuses.count(200) + statuses.count(429) == 40


def test_the_per_tenant_cap_rejects_in_the_loop() -> None:
    # One noisy tenant sends 36 of the 40 requests (2 seats): a cap of 3 queued refuses only its
    # own (the quiet tenant has at most 3 queued).
    trace = [
        dataclasses.replace(req, tenant="noisy" if i % 10 else "quiet")
        for i, req in enumerate(_burst(40))
    ]
    result = _run(trace, max_num_seqs=2, max_waiting=100, max_waiting_per_tenant=3)
    refused = [i for i, r in enumerate(result.records) if r.status == 429]
    assert result.rejected == {"tenant_queue_full": len(refused)} and refused
    assert all(trace[i].tenant == "noisy" for i in refused)


def test_a_prompt_longer_than_the_model_is_a_400() -> None:
    result = _run(_trace((0.0, 3000, 4), (0.0, 4, 4)))
    assert [r.status for r in result.records] == [400, 200]


def test_replicas_share_the_load() -> None:
    trace = _burst(64)
    for routing in ("round_robin", "least_kv", "random"):
        result = _run(trace, replicas=4, routing=routing, max_num_seqs=4)
        assert all(r.ok for r in result.records)
        per_replica = [len(series) for series in result.kv_usage]
        assert min(per_replica) > 0, (routing, per_replica)  # every replica served
    one = _run(trace, replicas=1, max_num_seqs=4)
    four = _run(trace, replicas=4, max_num_seqs=4)
    assert four.duration_s < one.duration_s / 2


def test_simulate_command_writes_the_design_json(tmp_path: Path, capsys: Any) -> None:
    profile = write_profile(tmp_path / "profile.json")
    trace = tmp_path / "trace.jsonl"
    requests = _burst(30)
    requests[0] = BenchRequest("Hello there, simulated world.", 0, 8, arrival_s=0.0)
    requests[1] = BenchRequest(
        "", 0, 8, arrival_s=0.0, priority="premium", messages=[{"role": "user", "content": "hi"}]
    )
    save_trace(requests, trace)
    small, big = tmp_path / "small.yaml", tmp_path / "big.yaml"
    small.write_text("max_num_seqs: 2\n")
    big.write_text("max-num-seqs: 32\n")
    out = tmp_path / "out.json"
    argv = ["simulate", "--trace", str(trace), "--profile", str(profile), "--config", str(small)]
    argv += ["--config", str(big), "--json", str(out), "--slo-ttft-ms", "100"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "small" in printed and "big" in printed and "TTFT p50" in printed
    data = json.loads(out.read_text())
    assert [r["config"] for r in data["runs"]] == ["small", "big"]
    for run in data["runs"]:
        assert set(run) >= {"config", "summary", "by_tier", "num_preemptions", "num_rejected"}
        assert set(run["summary"]) >= {"output_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms"}
        assert set(run["summary"]["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
        assert set(run["by_tier"]) == {"default", "premium"}
        assert run["summary"]["num_ok"] == 30
    small_run, big_run = data["runs"]
    assert small_run["summary"]["ttft_ms"]["p99"] > big_run["summary"]["ttft_ms"]["p99"]
    assert out.with_suffix(".png").is_file()


def test_simulate_command_refuses_bad_input(tmp_path: Path, capsys: Any) -> None:
    profile = str(write_profile(tmp_path / "profile.json"))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "max_tokens": 4}\n')
    assert main(["simulate", "--trace", str(trace), "--profile", profile]) == 2
    assert "prompt" in capsys.readouterr().err
    save_trace(_burst(2), trace)
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seq: 4\n")
    assert (
        main(["simulate", "--trace", str(trace), "--profile", profile, "--config", str(bad)]) == 2
    )
    assert "unknown setting" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace), "--profile", "nope"]) == 2
    assert "not a built-in" in capsys.readouterr().err


def test_closed_loop_keeps_the_concurrency() -> None:
    # Four requests, two in flight: each end sends the next at once (timestamps ignored).
    trace = _trace((5.0, 8, 2), (9.0, 8, 2), (9.0, 8, 2), (9.0, 8, 2))
    result = _run(trace, concurrency=2)
    assert all(r.ok for r in result.records)
    # Two rounds of (prefill 2 x 8 tokens, then a decode of 2): the same length each.
    first = result.records[0].e2e_s
    assert result.duration_s == pytest.approx(2 * first)


def test_requests_the_server_would_refuse_are_400s_and_the_rest_run() -> None:
    trace = [
        BenchRequest("", 10**9, 4, arrival_s=0.0),  # far too long: refused without building it
        BenchRequest("lone \ud800 surrogate", 0, 4, arrival_s=0.0),
        BenchRequest("", 0, 4, arrival_s=0.0),  # no prompt at all
        BenchRequest("", 0, 4, arrival_s=0.0, messages=[]),
        BenchRequest(
            "",
            0,
            4,
            arrival_s=0.0,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
        ),
        BenchRequest("fine", 0, 4, arrival_s=0.0),
    ]
    result = _run(trace)
    assert [r.status for r in result.records] == [400, 400, 400, 400, 200, 200]
    assert result.rejected == {"invalid": 4}


def test_bad_trace_lines_are_reported_with_their_line(tmp_path: Path) -> None:
    from iterserve.workload.workloads import load_trace

    path = tmp_path / "t.jsonl"
    for line, message in [
        ("[1, 2]", "JSON object"),
        ('{"timestamp": -5, "prompt": "x", "max_tokens": 1}', "timestamp"),
        ('{"timestamp": NaN, "prompt": "x", "max_tokens": 1}', "timestamp"),
        ('{"messages": [{"content": "hi"}], "max_tokens": 1}', "role"),
        ('{"prompt": null, "max_tokens": 1}', "prompt"),
    ]:
        path.write_text('{"prompt": "ok", "max_tokens": 1}\n' + line + "\n")
        with pytest.raises(ValueError, match=rf"t\.jsonl:2: .*{message}"):
            load_trace(path)
    path.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ValueError, match="UTF-8"):
        load_trace(path)


def test_unwritable_output_fails_before_the_replay(tmp_path: Path, capsys: Any) -> None:
    profile = str(write_profile(tmp_path / "profile.json"))
    trace = tmp_path / "trace.jsonl"
    save_trace(_burst(2), trace)
    argv = ["simulate", "--trace", str(trace), "--profile", profile, "--json", str(tmp_path)]
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err
