"""``iterserve simulate``: replay a trace under candidate configs; one table, JSON and a plot.

The JSON (``--json OUT``, docs/simulator.md) is ``{"runs": [{"config", "summary", "by_tier",
"num_preemptions", "num_rejected", ...}]}``: ``summary`` and ``by_tier`` carry ``bench
serve``'s fields (``output_tokens_per_s``, ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``
as ``{p50, p90, p99, mean}``, ...) plus ``queue_ms``, so a simulated and a measured run
compare field by field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from iterserve.config import (
    ENGINE_CONFIG_CLASSES,
    ConfigError,
    ServerConfig,
    SimulationConfig,
    load_config_file,
)
from iterserve.sim.profile import ProfileError, load_profile
from iterserve.sim.replay import replay
from iterserve.sim.tokenizer import load_tokenizer
from iterserve.workload.stats import SLO
from iterserve.workload.workloads import load_trace

_HEADER = (
    f"{'config':<22}{'tier':<13}{'reqs':>5}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}"
    f"{'TPOT p50':>10}{'p99':>7}{'ITL p99':>9}{'queue p99':>10}{'goodput':>9}"
    f"{'preempt':>8}{'refused':>8}{'failed':>7}{'KV peak':>8}"
)


def _row(name: str, tier: str, s: dict[str, Any], run: dict[str, Any] | None) -> str:
    def ms(d: dict[str, float], k: str) -> str:
        v = d[k]
        return "-" if math.isnan(v) else f"{v:.0f}"

    tail = ""
    if run is not None:
        peak = max((u for series in run["kv_usage"] for _, u in series), default=0.0)
        tail = (
            f"{run['num_preemptions']:>8}{run['num_rejected']:>8}"
            f"{run['summary']['num_failed']:>7}{peak:>8.1%}"
        )
    return (
        f"{name:<22}{tier:<13}{s['num_requests']:>5}{s['output_tokens_per_s']:>8.0f}"
        f"{ms(s['ttft_ms'], 'p50'):>10}{ms(s['ttft_ms'], 'p99'):>8}"
        f"{ms(s['tpot_ms'], 'p50'):>10}{ms(s['tpot_ms'], 'p99'):>7}{ms(s['itl_ms'], 'p99'):>9}"
        f"{ms(s['queue_ms'], 'p99'):>10}{s['goodput_requests_per_s']:>9.2f}{tail}"
    )


def format_table(runs: list[dict[str, Any]]) -> str:
    """One row per candidate (all tiers), then one per tier when there are several."""
    lines = [_HEADER]
    for run in runs:
        lines.append(_row(run["config"], "all", run["summary"], run))
        if len(run["by_tier"]) > 1:
            for tier, s in run["by_tier"].items():
                lines.append(_row("", tier, s, None))
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """p99 TTFT per tier, throughput, and KV usage over time, per candidate (None without
    matplotlib, which the control image may lack)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = [r["config"] for r in runs]
    tiers = sorted({t for r in runs for t in r["by_tier"]})
    width = 0.8 / max(1, len(tiers))
    for k, tier in enumerate(tiers):
        values = [r["by_tier"].get(tier, {}).get("ttft_ms", {}).get("p99", math.nan) for r in runs]
        axes[0].bar([i + k * width for i in range(len(runs))], values, width, label=tier)
    axes[0].set_xticks([i + width * (len(tiers) - 1) / 2 for i in range(len(runs))], names)
    axes[0].set_ylabel("p99 TTFT (ms)")
    axes[0].set_title("p99 TTFT by tier")
    axes[0].legend()
    axes[1].bar(names, [r["summary"]["output_tokens_per_s"] for r in runs])
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("throughput")
    for r in runs:
        for i, series in enumerate(r["kv_usage"]):
            if series:
                label = r["config"] + (f" #{i}" if len(r["kv_usage"]) > 1 else "")
                axes[2].plot([t for t, _ in series], [u for _, u in series], label=label)
    axes[2].set_xlabel("time (s, virtual)")
    axes[2].set_ylabel("KV cache usage")
    axes[2].set_title("KV usage over time")
    axes[2].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _engine_settings(path: Path) -> dict[str, Any]:
    """A candidate's engine settings: an ``iterserve serve --config`` file, whose server and
    simulation keys (port, api_key, simulate, ...) do not apply to a replay and are left out."""
    others = {f.name for cls in (ServerConfig, SimulationConfig) for f in dataclasses.fields(cls)}
    engine = {f.name for cls in ENGINE_CONFIG_CLASSES for f in dataclasses.fields(cls)}
    settings = load_config_file(path, engine | others)
    return {k: v for k, v in settings.items() if k in engine}


def main(args: argparse.Namespace) -> int:
    try:
        if args.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
        if args.concurrency is not None and args.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {args.concurrency}")
        profile = load_profile(args.profile)
        trace = load_trace(args.trace)
        candidates = [(p.stem, _engine_settings(p)) for p in args.config] or [("defaults", {})]
        tokenizer = load_tokenizer(args.tokenizer, profile.model.vocab_size)
        stem = f"simulate-{time.strftime('%Y%m%d-%H%M%S')}"
        json_path = args.json or args.output_dir / f"{stem}.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text("")  # fail now, not after the replay, on a path we cannot write
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
        runs = []
        for name, kwargs in candidates:
            kwargs.setdefault("seed", args.seed)
            if args.tokenizer:
                kwargs.setdefault("model", args.tokenizer)
            replayed = replay(
                trace,
                profile,
                kwargs,
                tokenizer,
                args.replicas,
                args.routing,
                args.seed,
                args.concurrency,
                args.prefix_affinity,
            )
            run = replayed.report(name, slo)
            run["settings"] = kwargs
            runs.append(run)
    except (ConfigError, ProfileError, TypeError, ValueError, OSError) as e:
        print(f"iterserve simulate: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{len(trace)} requests from {args.trace} on profile {profile.name} "
        f"({profile.source.hardware}), {args.replicas} replica(s), routing {args.routing}"
    )
    print(format_table(runs))
    for run in runs:
        print(
            f"{run['config']}: {run['summary']['duration_s']:.1f} s of virtual time in "
            f"{run['wall_s']:.2f} s ({run['speedup_vs_real_time']:.0f}x real time), "
            f"{run['num_iterations']} iterations"
        )
    result: dict[str, Any] = {
        "trace": str(args.trace),
        "profile": profile.name,
        "replicas": args.replicas,
        "routing": args.routing,
        "seed": args.seed,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "runs": runs,
    }
    json_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {json_path}")
    if not args.no_plot:
        png = plot(runs, json_path.with_suffix(".png"))
        print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    return 0
