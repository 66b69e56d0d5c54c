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
from iterserve.bench.stats import SLO, summarize
from iterserve.bench.workloads import make_workload, save_trace
from iterserve.sim.profile import load_profile
from iterserve.sim.replay import replay
from iterserve.sim.tokenizer import FileTokenizer

LOAD_FACTORS = (0.6, 1.5)
# (metric, key, tolerance) compared as simulated / measured.
TARGETS = (
    ("output tok/s", ("output_tokens_per_s",), 0.15),
    ("TPOT p50", ("tpot_ms", "p50"), 0.15),
    ("TTFT p50", ("ttft_ms", "p50"), 0.30),
    ("TTFT p99", ("ttft_ms", "p99"), 0.30),
)


@contextmanager
def real_server(port: int, flags: list[str]) -> Iterator[str]:
    """``iterserve serve`` on the default model, ready; stopped on exit."""
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
        yield url
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
    with real_server(args.port, []) as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
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
                records, wall, cpu = asyncio.run(
                    run_load(url, trace, model, _client_args(args), rate)
                )
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
                    "simulated_preemptions": simulated["num_preemptions"],
                    "comparison": compare(simulated["summary"], real),
                }
                runs.append(run)
                print(format_run(run), flush=True)
    return runs


def format_run(run: dict[str, Any]) -> str:
    lines = [
        f"{run['workload']} at {run['load_factor']}x the simulated capacity "
        f"({run['rate']:.2f} req/s; client CPU {run['client_cpu_fraction']:.0%} of a core)",
        f"  {'metric':<14}{'measured':>10}{'simulated':>11}{'sim/real':>9}  target",
    ]
    for row in run["comparison"]:
        mark = "ok" if row["within"] else "MISS"
        lines.append(
            f"  {row['metric']:<14}{row['measured']:>10.1f}{row['simulated']:>11.1f}"
            f"{row['ratio']:>9.2f}  +-{row['tolerance']:.0%} {mark}"
        )
    return "\n".join(lines)


# The design card's figures for 4x A100, Llama-3-70B class, 128 concurrent requests.
DESIGN_TOKENS_PER_S = {"static": 3200.0, "continuous": 6200.0, "continuous+chunked": 8000.0}
PRODUCTION_CONFIGS: dict[str, dict[str, Any]] = {
    "static": {
        "batching": "static",
        "max_num_seqs": 128,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    },
    "continuous": {
        "max_num_seqs": 128,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    },
    "continuous+chunked": {"max_num_seqs": 128, "max_num_batched_tokens": 512},
}


def production_table(num_requests: int, seed: int) -> dict[str, Any]:
    """The three batching modes on the A100 profile, closed loop at 128 concurrent requests
    of the ``mixed`` shape (prompt lengths only: no tokenizer of that model ships here)."""
    from iterserve.sim.tokenizer import CharTokenizer

    profile = load_profile("a100x4-llama3-70b")
    tokenizer = CharTokenizer(profile.model.vocab_size)
    trace = make_workload("mixed", None, num_requests, seed)
    rows = {}
    for name, kwargs in PRODUCTION_CONFIGS.items():
        result = replay(trace, profile, dict(kwargs), tokenizer, seed=seed, concurrency=128)
        report = result.report(name, SLO())
        rows[name] = {
            "output_tokens_per_s": report["summary"]["output_tokens_per_s"],
            "ttft_p99_ms": report["summary"]["ttft_ms"]["p99"],
            "tpot_p50_ms": report["summary"]["tpot_ms"]["p50"],
            "design_tokens_per_s": DESIGN_TOKENS_PER_S[name],
        }
    # The floor: every decode iteration reads all weights once and every request's KV.
    mean_context = sum(r.prompt_len + r.output_len / 2 for r in trace) / len(trace)
    weights_s = 141e9 / (4 * 2.04e12)
    kv_s = 128 * mean_context * profile.kv_cache.kv_bytes_per_token / (4 * 2.04e12)
    floor = {
        "mean_context_tokens": mean_context,
        "iteration_floor_ms": (weights_s + kv_s) * 1000,
        "tokens_per_s_ceiling": 128 / (weights_s + kv_s),
    }
    return {"rows": rows, "read_floor": floor}


def format_production(table: dict[str, Any]) -> str:
    floor = table["read_floor"]
    lines = [
        "A100 x4 (TP 4) profile, 128 concurrent mixed requests, simulated:",
        f"  {'mode':<20}{'tok/s':>8}{'design':>8}{'TTFT p99 ms':>13}{'TPOT p50 ms':>13}",
    ]
    for name, row in table["rows"].items():
        lines.append(
            f"  {name:<20}{row['output_tokens_per_s']:>8.0f}{row['design_tokens_per_s']:>8.0f}"
            f"{row['ttft_p99_ms']:>13.0f}{row['tpot_p50_ms']:>13.1f}"
        )
    lines.append(
        f"  weight + KV read floor: {floor['iteration_floor_ms']:.1f} ms per decode iteration at "
        f"a mean context of {floor['mean_context_tokens']:.0f} tokens, so at most "
        f"{floor['tokens_per_s_ceiling']:.0f} decode tokens/s at batch 128"
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
