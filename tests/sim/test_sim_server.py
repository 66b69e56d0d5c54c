"""``iterserve serve --simulate``: the whole server over the simulated runner, in one light
process without torch, answering the ``openai`` client at the profile's pace."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_utils import Server, run_server
from sim_profiles import make_profile, write_profile

from iterserve.cli import main
from iterserve.workload.workloads import BenchRequest, save_trace

# 40 ms per iteration (+1 ms per decode token): gaps a client can measure on a busy machine.
FIXED_S = 0.040


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "profile.json"
    return write_profile(path, make_profile(fixed_s=FIXED_S))


@pytest.fixture(scope="module")
def sim_server(profile_file: Path) -> Any:
    with run_server("--simulate", str(profile_file), startup_timeout_s=30) as server:
        yield server


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_streams_follow_the_profile(sim_server: Server) -> None:
    client = openai.OpenAI(base_url=sim_server.url + "/v1", api_key="none", max_retries=0)
    stamps = []
    text = ""
    stream = client.completions.create(
        model="Test-Model",
        prompt="The simulator runs the real scheduler.",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                stamps.append(time.perf_counter())
                text += choice.text
    assert usage is not None and usage.completion_tokens == 12
    assert len(text) == 12 * 4  # ~4 characters per token without a tokenizer file
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    # Each decode iteration is predicted at 41 ms; the client sees the same pace.
    assert 0.8 * 0.041 <= statistics.median(gaps) <= 1.5 * 0.041, gaps


def test_chat_and_non_streamed_answers(sim_server: Server) -> None:
    client = openai.OpenAI(base_url=sim_server.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="Test-Model", messages=[{"role": "user", "content": "Hi!"}], max_tokens=5
    )
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.completion_tokens <= 5
    again = client.chat.completions.create(
        model="Test-Model", messages=[{"role": "user", "content": "Hi!"}], max_tokens=5
    )
    assert again.choices[0].message.content == chat.choices[0].message.content  # deterministic
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="Test-Model", prompt="x", max_tokens=0)


def test_one_light_process_without_torch(sim_server: Server) -> None:
    pid = sim_server.proc.pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps
    assert _rss_mb(pid) < 150
    load = httpx.get(sim_server.url + "/load").json()
    assert load["num_total_blocks"] == 256


def test_bench_serve_against_a_simulated_server(
    sim_server: Server, tmp_path: Path, capsys: Any
) -> None:
    from iterserve.bench import serve as bench_serve
    from iterserve.cli import build_parser

    trace = tmp_path / "trace.jsonl"
    prompts = ["Tell me about paged attention.", "Why batch at every iteration?"] * 3
    save_trace([BenchRequest(p, 0, 6, arrival_s=i * 0.02) for i, p in enumerate(prompts)], trace)
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--url",
            sim_server.url,
            "--trace",
            str(trace),
            "--no-progress",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert isinstance(args, argparse.Namespace)
    assert bench_serve.main(args) == 0
    data = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    summary = data["summary"]
    assert summary["num_ok"] == 6 and summary["output_tokens"] == 36
    assert summary["tpot_ms"]["p50"] >= 0.8 * 41


def test_speed_scales_wall_time_and_metrics_keep_profile_time(profile_file: Path) -> None:
    with run_server("--simulate", str(profile_file), "--simulate-speed", "10") as server:
        start = time.perf_counter()
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "abcd" * 8, "max_tokens": 10, "ignore_eos": True},
            timeout=30,
        )
        wall = time.perf_counter() - start
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
        # Ten iterations of >= 40 ms of profile time took well under a second of wall time.
        assert wall < 10 * FIXED_S
        metrics = httpx.get(server.url + "/metrics").text
        values = {}
        for line in metrics.splitlines():
            for name in ("sum", "count"):
                if line.startswith(f"iterserve_iteration_latency_seconds_{name} "):
                    values[name] = float(line.split()[1])
        mean = values["sum"] / values["count"]
        # Profile seconds, not wall seconds (those would be a tenth); a busy machine delays
        # the scaled clock's thread, and each wall millisecond late reads as ten.
        assert FIXED_S <= mean <= 3 * FIXED_S


def test_tensor_parallel_degree_must_match_the_profile(profile_file: Path, capsys: Any) -> None:
    argv = ["serve", "--simulate", str(profile_file), "--tensor-parallel-size", "4"]
    assert main(argv) == 2
    assert "measured at tensor parallel degree 1" in capsys.readouterr().err
    assert main(["serve", "--simulate", "no-such-profile"]) == 2
    assert "no latency profile" in capsys.readouterr().err
    assert main(["serve", "--simulate", str(profile_file), "--simulate-speed", "0"]) == 2
