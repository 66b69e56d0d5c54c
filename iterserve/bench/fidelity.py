"""``iterserve bench fidelity``: the simulator against the real server, on the same traces.

For each workload (``mixed``, ``long-prompt``) and two loads, one trace (Poisson arrivals at a
fraction of the capacity the simulator predicts for a burst of the same requests: 0.6x under,
1.5x over) is replayed through the real server on the default model (``bench serve``'s
client) and through :func:`~iterserve.sim.replay.replay` with the profile calibrated on this
machine, in one run. Reported: output tokens/s and p50 TPOT (target within 15%), p50 and
p99 TTFT (within 30%), as simulated / measured.

``--production`` adds the design's production table on the A100 profile (no real server):
static batching vs continuous batching vs continuous + chunked prefill at 128 concurrent
requests of the ``mixed`` shape, with the weight-and-KV read floor.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from iterserve.bench.common import warn_if_loaded
from iterserve.bench.serve import arrival_times, run_load
from iterserve.sim.profile import load_profile
from iterserve.sim.replay import replay
from iterserve.sim.tokenizer import FileTokenizer
from iterserve.workload.stats import SLO, summarize
from iterserve.workload.workloads import BenchRequest, make_workload, save_trace

LOAD_FACTORS = (0.6, 1.5)
# (metric, key, tolerance) compared as simulated / measured.
TARGETS = (
    ("output tok/s", ("output_tokens_per_s",), 0.15),
    ("TPOT p50", ("tpot_ms", "p50"), 0.15),
    ("TTFT p50", ("ttft_ms", "p50"), 0.30),
    ("TTFT p99", ("ttft_ms", "p99"), 0.30),
)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_pids(pid: int) -> dict[str, int]:
    """The HTTP process and its engine child (``ProcessEngine`` spawns it)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    engine = [int(c) for c in children if "spawn_main" in _cmdline(int(c))]
    return {"http": pid, "engine": engine[0]} if engine else {"http": pid}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


@contextmanager
def real_server(port: int, flags: list[str]) -> Iterator[tuple[str, int]]:
    """``iterserve serve`` on the default model, ready; (its URL, its pid); stopped on exit."""
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server was not ready in 300 s")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _value(summary: dict[str, Any], key: tuple[str, ...]) -> float:
    value: Any = summary
    for k in key:
        value = value[k]
    return float(value)


def compare(sim: dict[str, Any], real: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, key, tolerance in TARGETS:
        s, r = _value(sim, key), _value(real, key)
        ratio = s / r if r > 0 else math.nan
        rows.append(
            {
                "metric": name,
                "simulated": s,
                "measured": r,
                "ratio": ratio,
                "tolerance": tolerance,
                "within": abs(ratio - 1) <= tolerance,
            }
        )
    return rows


def _client_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        api_key=None,
        timeout_s=1800.0,
        burst=None,
        burst_interval_s=0.0,
        seed=args.seed,
        concurrency=None,
        no_progress=True,
        endpoint="completions",
        plain=False,
    )


def fidelity_runs(args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    from iterserve.models.loader import resolve_model_dir

    model_dir = resolve_model_dir("default")
    tokenizer = FileTokenizer(model_dir)
    profile = load_profile(args.profile)
    slo = SLO()
    engine_kwargs = {"model": str(model_dir)}
    runs = []
    with real_server(args.port, []) as (url, pid):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        pids = _server_pids(pid)
        for w, workload in enumerate(args.workloads.split(",")):
            for f, factor in enumerate(LOAD_FACTORS):
                # Fresh prompts per run: the real server's prefix cache keeps earlier runs'.
                seed = args.seed + 100 * w + f
                requests = make_workload(
                    workload, tokenizer, args.num_requests, seed, args.max_output_len
                )
                burst = replay(requests, profile, engine_kwargs, tokenizer, seed=seed)
                capacity = len(requests) / burst.duration_s
                rate = factor * capacity
                offsets = arrival_times(len(requests), rate, None, 0.0, seed)
                trace = [
                    dataclasses.replace(r, arrival_s=o)
                    for r, o in zip(requests, offsets, strict=True)
                ]
                save_trace(trace, out_dir / f"trace-{workload}-{factor}x.jsonl")
                before = _iteration_totals(url)
                cpu_before = {name: _cpu_seconds(p) for name, p in pids.items()}
                records, wall, cpu = asyncio.run(
                    run_load(url, trace, model, _client_args(args), rate)
                )
                after = _iteration_totals(url)
                server_cpu = {
                    name: (_cpu_seconds(p) - cpu_before[name]) / max(wall, 1e-9)
                    for name, p in pids.items()
                }
                num_iterations = after[1] - before[1]
                real = summarize(records, wall, slo)
                sim = replay(trace, profile, engine_kwargs, tokenizer, seed=seed)
                simulated = sim.report(f"{workload} {factor}x", slo)
                run = {
                    "workload": workload,
                    "load_factor": factor,
                    "rate": rate,
                    "simulated_capacity_rps": capacity,
                    "measured": real,
                    "simulated": simulated["summary"],
                    "client_cpu_fraction": cpu / max(wall, 1e-9),
                    # Cores busy on average: the HTTP process, the engine process.
                    "server_cpu_cores": server_cpu,
                    "simulated_preemptions": simulated["num_preemptions"],
                    "iterations": {
                        "measured": num_iterations,
                        "simulated": simulated["num_iterations"],
                        "measured_mean_ms": (after[0] - before[0]) / max(1, num_iterations) * 1e3,
                        "simulated_mean_ms": simulated["mean_iteration_ms"],
                    },
                    "comparison": compare(simulated["summary"], real),
                }
                runs.append(run)
                print(format_run(run), flush=True)
    return runs


def _iteration_totals(url: str) -> tuple[float, float]:
    """The server's ``iterserve_iteration_latency_seconds`` sum and count so far."""
    values = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in values:
            if line.startswith(f"iterserve_iteration_latency_seconds_{name} "):
                values[name] = float(line.split()[1])
    return values["sum"], values["count"]


def format_run(run: dict[str, Any]) -> str:
    it = run["iterations"]
    lines = [
        f"{run['workload']} at {run['load_factor']}x the simulated capacity "
        f"({run['rate']:.2f} req/s; client CPU {run['client_cpu_fraction']:.0%} of a core)",
        f"  iterations: measured {it['measured']:.0f} of {it['measured_mean_ms']:.1f} ms mean, "
        f"simulated {it['simulated']} of {it['simulated_mean_ms']:.1f} ms mean; cores busy: "
        + ", ".join(f"{k} {v:.2f}" for k, v in run["server_cpu_cores"].items()),
        f"  {'metric':<14}{'measured':>10}{'simulated':>11}{'sim/real':>9}  target",
    ]
    for row in run["comparison"]:
        mark = "ok" if row["within"] else "MISS"
        lines.append(
            f"  {row['metric']:<14}{row['measured']:>10.1f}{row['simulated']:>11.1f}"
            f"{row['ratio']:>9.2f}  +-{row['tolerance']:.0%} {mark}"
        )
    return "\n".join(lines)


# The target output throughputs (tokens/s) the project's design set for 4x A100, Llama-3-70B
# class, 128 concurrent requests (docs/benchmarks.md, "Simulator fidelity").
TARGET_TOKENS_PER_S = {"static": 3200.0, "continuous": 6200.0, "continuous+chunked": 8000.0}
PRODUCTION_CONFIGS: dict[str, dict[str, Any]] = {
    # A static batch is what the first iteration admits: a budget for 128 whole prompts.
    "static": {
        "batching": "static",
        "max_num_seqs": 128,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 128 * 4096,
    },
    "continuous": {
        "max_num_seqs": 128,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    },
    "continuous+chunked": {"max_num_seqs": 128, "max_num_batched_tokens": 512},
}


def _decode_heavy(num_requests: int, seed: int) -> list[BenchRequest]:
    """Short prompts, long answers: 128-256 prompt tokens, 256-512 output tokens."""
    rng = random.Random(seed)
    return [
        BenchRequest("", rng.randint(128, 256), rng.randint(256, 512)) for _ in range(num_requests)
    ]


def production_table(num_requests: int, seed: int) -> dict[str, Any]:
    """The three batching modes on the A100 profile, closed loop at 128 concurrent requests,
    for the ``mixed`` shape and a decode-heavy one (prompt lengths only: no tokenizer of that
    model ships here)."""
    from iterserve.sim.tokenizer import CharTokenizer

    profile = load_profile("a100x4-llama3-70b")
    tokenizer = CharTokenizer(profile.model.vocab_size)
    workloads = {
        "mixed": make_workload("mixed", None, num_requests, seed),
        "decode-heavy": _decode_heavy(num_requests, seed),
    }
    tables = {}
    for workload, trace in workloads.items():
        rows = {}
        for name, kwargs in PRODUCTION_CONFIGS.items():
            result = replay(trace, profile, dict(kwargs), tokenizer, seed=seed, concurrency=128)
            summary = result.report(name, SLO())["summary"]
            rows[name] = {
                "output_tokens_per_s": summary["output_tokens_per_s"],
                "ttft_p99_ms": summary["ttft_ms"]["p99"],
                "tpot_p50_ms": summary["tpot_ms"]["p50"],
                "itl_p99_ms": summary["itl_ms"]["p99"],
                "design_tokens_per_s": TARGET_TOKENS_PER_S[name],
            }
        # The floor: a decode iteration reads every weight once and every request's KV.
        mean_context = sum(r.prompt_len + r.output_len / 2 for r in trace) / len(trace)
        hbm_bytes_per_s = 4 * 2.04e12
        weights_s = 141e9 / hbm_bytes_per_s
        kv_s = 128 * mean_context * profile.kv_cache.kv_bytes_per_token / hbm_bytes_per_s
        tables[workload] = {
            "rows": rows,
            "read_floor": {
                "mean_context_tokens": mean_context,
                "iteration_floor_ms": (weights_s + kv_s) * 1000,
                "tokens_per_s_ceiling": 128 / (weights_s + kv_s),
            },
        }
    return tables


def format_production(tables: dict[str, Any]) -> str:
    lines = ["A100 x4 (TP 4) profile, 128 concurrent requests (closed loop), simulated:"]
    for workload, table in tables.items():
        floor = table["read_floor"]
        lines.append(
            f"  {workload:<20}{'tok/s':>8}{'design':>8}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'ITL p99':>9}   (ms)"
        )
        for name, row in table["rows"].items():
            lines.append(
                f"    {name:<18}{row['output_tokens_per_s']:>8.0f}"
                f"{row['design_tokens_per_s']:>8.0f}{row['ttft_p99_ms']:>10.0f}"
                f"{row['tpot_p50_ms']:>10.1f}{row['itl_p99_ms']:>9.0f}"
            )
        lines.append(
            f"    read floor: {floor['iteration_floor_ms']:.1f} ms per decode iteration at a "
            f"mean context of {floor['mean_context_tokens']:.0f} tokens: at most "
            f"{floor['tokens_per_s_ceiling']:.0f} tokens/s at batch 128, prefill aside"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels, ratios, colors = [], [], []
    for run in runs:
        for row in run["comparison"]:
            labels.append(f"{run['workload']} {run['load_factor']}x\n{row['metric']}")
            ratios.append(row["ratio"])
            colors.append("tab:green" if row["within"] else "tab:red")
    ax.bar(range(len(ratios)), ratios, color=colors)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("simulated / measured")
    ax.set_title("simulator fidelity (green: within target)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    out_dir = args.output_dir / f"fidelity-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"profile": args.profile, "cpu_count": os.cpu_count()}
    if not args.production_only:
        warn_if_loaded()
        result["runs"] = runs = fidelity_runs(args, out_dir)
        print(f"wrote {plot(runs, out_dir / 'fidelity.png')}")
    if args.production or args.production_only:
        table = production_table(args.production_requests, args.seed)
        result["production"] = table
        print(format_production(table))
    path = out_dir / "fidelity.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0
