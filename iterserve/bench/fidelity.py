"""``iterserve bench fidelity``: the simulator against the real server, on traces the profile
was not fitted on.

One sitting (the machine's speed drifts over an hour, so calibration and replays belong
together)::

    1. calibrate   ``iterserve bench calibrate --out DIR/profile.json`` as a subprocess
                   (``--no-calibrate``: ``--profile`` instead); a refused profile (non-zero
                   exit) stops the run with its reason
    2. per shape   build the trace (:mod:`iterserve.bench.fidelity_shapes`: rates relative to
                   the simulated capacity on that profile); replay it ``--repeat-real`` times
                   through a real ``iterserve serve`` on the default model (``bench serve``'s
                   client), a fresh server each time; once through
                   :func:`~iterserve.sim.replay.replay`
    3. compare     every metric, simulated / measured, beside the real replays' own spread
                   (:mod:`iterserve.bench.fidelity_compare`); per shape and per tier

Decision: each real replay gets a fresh server, rather than one server reset between
replays. The server has no endpoint that empties its prefix cache, and a restart also empties
what a reset would miss (queues, the admission's wait estimates, the metrics): each replay
starts where the simulator starts. A one-token warm-up request (too short to fill a cached
block) runs before the trace, so the first forward's one-off cost is not in the figures.

``--production`` adds the design's production table on the A100 profile (no real server):
static batching vs continuous batching vs continuous + chunked prefill at 128 concurrent
requests of the ``mixed`` shape, with the weight-and-KV read floor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from iterserve.bench.common import warn_if_loaded
from iterserve.bench.fidelity_compare import (
    compare,
    compare_by_tier,
    format_rejections,
    format_rows,
    rejections_by_tier,
)
from iterserve.bench.fidelity_real import FidelityError, real_replay
from iterserve.bench.fidelity_shapes import (
    FIDELITY_TIERS,
    ShapeTrace,
    build_trace,
    parse_shapes,
    shape_seed,
)
from iterserve.sim.profile import LatencyProfile, load_profile
from iterserve.sim.replay import replay
from iterserve.sim.tokenizer import FileTokenizer
from iterserve.workload.stats import SLO
from iterserve.workload.workloads import BenchRequest, make_workload, save_trace


def _calibrate_command() -> list[str]:
    """``iterserve bench calibrate`` in this interpreter (tests put a fast stand-in here)."""
    return [sys.executable, "-m", "iterserve.cli", "bench", "calibrate"]


def calibrate(out_dir: Path, extra_args: list[str]) -> Path:
    """Run ``iterserve bench calibrate`` (its output echoed as it comes); the profile's path.

    Raises:
        FidelityError: it exited non-zero (a refused profile): the reason is its last lines.
    """
    path = out_dir / "profile.json"
    cmd = [*_calibrate_command(), "--out", str(path)]
    cmd += ["--output-dir", str(out_dir / "calibrate"), *extra_args]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip())
    if proc.returncode != 0:
        reason = "\n".join(lines[-10:]) or "(no output)"
        raise FidelityError(f"bench calibrate exited with {proc.returncode}:\n{reason}")
    if not path.is_file():
        raise FidelityError(f"bench calibrate exited 0 but wrote no profile at {path}")
    return path


def shape_run(
    trace: ShapeTrace,
    profile: LatencyProfile,
    tokenizer: FileTokenizer,
    engine_kwargs: dict[str, Any],
    args: argparse.Namespace,
    out_dir: Path,
) -> dict[str, Any]:
    """One shape: ``--repeat-real`` real replays, one simulated, and their comparisons."""
    shape = trace.shape
    save_trace(trace.requests, out_dir / f"trace-{shape.name}.jsonl")
    flags = ["--tiers", str(out_dir / "tiers.yaml")] if shape.tiers else []
    flags += shlex.split(args.server_args)
    real = [
        real_replay(trace, flags, args, out_dir / f"server-{shape.name}-{i}.log")
        for i in range(args.repeat_real)
    ]
    kwargs = shape.engine_kwargs(engine_kwargs)
    sim = replay(trace.requests, profile, kwargs, tokenizer, seed=trace.seed)
    simulated = sim.report(shape.name, SLO())
    return {
        "shape": shape.name,
        "workload": shape.workload,
        "arrivals": f"bursts of {shape.burst}" if shape.burst else "poisson",
        "load_factor": shape.load_factor,
        "rate": trace.rate,
        "simulated_capacity_rps": trace.simulated_capacity_rps,
        "num_requests": len(trace.requests),
        "measured": real,
        "simulated": {
            "summary": simulated["summary"],
            "by_tier": simulated["by_tier"],
            "rejected_429": rejections_by_tier(sim.records),
            "num_preemptions": simulated["num_preemptions"],
            "iterations": simulated["num_iterations"],
            "mean_iteration_ms": simulated["mean_iteration_ms"],
        },
        "comparison": compare(simulated["summary"], [r["summary"] for r in real]),
        "comparison_by_tier": compare_by_tier(simulated["by_tier"], [r["by_tier"] for r in real]),
    }


def fidelity_runs(
    args: argparse.Namespace, profile_path: str | Path, out_dir: Path
) -> list[dict[str, Any]]:
    """Every shape of ``--shapes``, printed as it ends."""
    from iterserve.models.loader import resolve_model_dir

    model_dir = resolve_model_dir("default")
    tokenizer = FileTokenizer(model_dir)
    profile = load_profile(profile_path)
    engine_kwargs: dict[str, Any] = {"model": str(model_dir)}
    (out_dir / "tiers.yaml").write_text(yaml.safe_dump(FIDELITY_TIERS, sort_keys=False))
    runs = []
    for shape in args.shapes:
        seed = shape_seed(shape, args.seed)
        trace = build_trace(
            shape, tokenizer, profile, engine_kwargs, args.num_requests, seed, args.max_output_len
        )
        run = shape_run(trace, profile, tokenizer, engine_kwargs, args, out_dir)
        runs.append(run)
        print(format_run(run), flush=True)
    return runs


def format_run(run: dict[str, Any]) -> str:
    """A shape's block: what was sent, iterations and cores, the comparison, per tier when
    there are several, and the 429s."""
    real = run["measured"]
    sim = run["simulated"]
    lines = [
        f"{run['shape']}: {run['num_requests']} {run['workload']} requests, {run['arrivals']} at "
        f"{run['load_factor']}x the simulated capacity ({run['rate']:.2f} req/s); "
        f"{len(real)} real replay(s)",
        "  iterations: real "
        + " / ".join(f"{r['iterations']:.0f} of {r['mean_iteration_ms']:.1f} ms" for r in real)
        + f", simulated {sim['iterations']} of {sim['mean_iteration_ms']:.1f} ms; cores busy: "
        + " / ".join(
            ", ".join(f"{k} {v:.2f}" for k, v in r["server_cpu_cores"].items()) for r in real
        ),
        *format_rows(run["comparison"]),
    ]
    if len(run["comparison_by_tier"]) > 1:
        for tier, rows in run["comparison_by_tier"].items():
            lines.append(f"  tier {tier}:")
            lines.extend(format_rows(rows, indent="    "))
    lines.append(format_rejections([r["rejected_429"] for r in real], sim["rejected_429"]))
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
    """Bars of simulated / measured per shape and metric (green within target, orange a miss
    the real spread explains, red a miss, grey no target), with the range the real replays
    span as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ok": "tab:green", "noise": "tab:orange", "miss": "tab:red", "-": "tab:gray"}
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * 7 * len(runs)), 4.5))
    labels, ratios, bar_colors, low, high = [], [], [], [], []
    for run in runs:
        for row in run["comparison"]:
            labels.append(f"{run['shape']}\n{row['metric']}")
            ratio = row["ratio"] if math.isfinite(row["ratio"]) else 0.0
            ratios.append(ratio)
            bar_colors.append(colors[row["verdict"]])
            finite = [v for v in row["measured_runs"] if math.isfinite(v) and v > 0]
            s = row["simulated"]
            span = [s / v for v in finite] if finite and math.isfinite(s) else [ratio]
            low.append(max(0.0, ratio - min(span)))
            high.append(max(0.0, max(span) - ratio))
    ax.bar(range(len(ratios)), ratios, color=bar_colors, yerr=[low, high], capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("simulated / measured")
    ax.set_title("simulator fidelity (green: within target; orange: within the real spread)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _check_args(args: argparse.Namespace) -> None:
    """Raises ValueError for flags out of range (``--shapes`` is parsed here too)."""
    if isinstance(args.shapes, str):
        args.shapes = parse_shapes(args.shapes)
    for flag in ("server_args", "calibrate_args"):
        try:
            shlex.split(getattr(args, flag))
        except ValueError as e:
            raise ValueError(f"--{flag.replace('_', '-')}: {e}") from e
    if args.repeat_real < 1:
        raise ValueError(f"--repeat-real must be >= 1, got {args.repeat_real}")
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.max_output_len < 1:
        raise ValueError(f"--max-output-len must be >= 1, got {args.max_output_len}")
    if not args.calibrate and args.profile is None:
        raise ValueError("--no-calibrate needs --profile (a name or a profile JSON)")
    if args.calibrate and args.profile is not None:
        raise ValueError("--profile is for --no-calibrate (the run calibrates its own)")


def main(args: argparse.Namespace) -> int:
    """Calibrate (unless ``--no-calibrate``), replay every shape, print and write
    ``fidelity.json`` and ``fidelity.png``. Returns 0; 2 for bad flags; 1 when the run
    stopped (a refused calibration, a server that did not start): the reason is printed and
    kept in the JSON as ``error``."""
    try:
        _check_args(args)
    except ValueError as e:
        print(f"iterserve bench fidelity: error: {e}", file=sys.stderr)
        return 2
    out_dir = args.output_dir / f"fidelity-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    path = out_dir / "fidelity.json"
    status = 0
    if not args.production_only:
        status = _fidelity(args, out_dir, result)
    if status == 0 and (args.production or args.production_only):
        table = production_table(args.production_requests, args.seed)
        result["production"] = table
        print(format_production(table))
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return status


def _fidelity(args: argparse.Namespace, out_dir: Path, result: dict[str, Any]) -> int:
    """Steps 1-3 of the module docstring into ``result``; 0, or 1 with ``result['error']``."""
    warn_if_loaded()
    result["shapes"] = [s.name for s in args.shapes]
    result["repeat_real"] = args.repeat_real
    try:
        if args.calibrate:
            start = time.perf_counter()
            profile = calibrate(out_dir, shlex.split(args.calibrate_args))
            result["calibration"] = {"seconds": time.perf_counter() - start}
        else:
            profile = args.profile
        result["profile"] = str(profile)
        result["runs"] = runs = fidelity_runs(args, profile, out_dir)
    except FidelityError as e:
        print(f"iterserve bench fidelity: stopped: {e}", file=sys.stderr)
        result["error"] = str(e)
        return 1
    result["load_average_end"] = os.getloadavg()
    print(f"wrote {plot(runs, out_dir / 'fidelity.png')}")
    return 0
