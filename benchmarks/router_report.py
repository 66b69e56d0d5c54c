"""Tables and the plot of ``python -m benchmarks.router`` (from its JSON parts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def format_overhead(o: dict[str, Any]) -> str:
    keys = ("idle_ttft_p50_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    lines = [
        f"overhead: 1 replica ({o['profile']}, speed 1, prefix caching off), "
        f"{o['prompt_len']}-token prompts; idle: {o['num_idle_requests']} one at a time, "
        f"4 tokens out; loaded: "
        f"{o['num_requests']} at Poisson {o['rate_rps']:g} req/s, {o['output_len']} tokens out; "
        f"x {o['repeats']} repeats per path, alternating",
        f"  {'':<8}{'idle TTFT':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"
        "   (ms; idle: p50)",
    ]
    for mode in ("direct", "router"):
        lines.append(f"  {mode:<8}" + "".join(f"{o[mode][k]:>10.2f}" for k in keys))
    lines.append(f"  {'added':<8}" + "".join(f"{o['added_ms'][k]:>+10.2f}" for k in keys))
    per_run = ", ".join(f"{r['mode']} {r['ttft_p50_ms']:.1f}" for r in o["runs"])
    lines.append(f"  loaded TTFT p50 of each run, in order: {per_run}")
    lines.append(
        "  each request's TTFT through the router - directly: "
        f"p50 {o['added_ms']['paired_ttft_p50_ms']:+.2f} ms, "
        f"p90 {o['added_ms']['paired_ttft_p90_ms']:+.2f} ms"
    )
    lines.append(
        f"  router CPU: {o['router_cpu_s_per_request'] * 1e3:.2f} ms per loaded request "
        f"({o['router_proxy_cpu_s_per_request'] * 1e3:.2f} ms without its polling, which "
        f"alone keeps {o['router_poll_cpu_fraction']:.1%} of a core busy); goal p50 TTFT "
        f"added < {o['goal_ttft_p50_ms']:g} ms: {'met' if o['goal_met'] else 'MISSED'}"
    )
    return "\n".join(lines)


def format_balance(b: dict[str, Any]) -> str:
    title = (
        f"balance: {b['num_replicas']} replicas at speed {b['simulate_speed']:g}, mixed, "
        f"{b['num_requests']} requests, Poisson {b['rate_rps']:.2f} req/s "
        f"({b['load_factor']:g}x the burst capacity {b['capacity_rps']:.2f} req/s)"
    )
    return format_policies(title, b["policies"], sim=True)


def format_affinity(a: dict[str, Any]) -> str:
    title = (
        f"affinity: {a['num_groups']} system prompts of {a['prefix_len']} tokens, "
        f"{a['num_requests']} requests, {a['num_replicas']} replicas at speed "
        f"{a['simulate_speed']:g}, Poisson {a['rate_rps']:.2f} req/s ({a['load_factor']:g}x "
        f"the burst capacity)"
    )
    return format_policies(title, a["runs"], sim=False)


def format_policies(title: str, runs: dict[str, dict[str, Any]], sim: bool) -> str:
    lines = [
        title,
        f"  {'run':<30}{'ok/sent':>9}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
        + (f"{'sim p99':>9}" if sim else "")
        + f"{'TPOT p50':>10}{'out tok/s':>10}{'req/s':>7}   (ms, profile time)",
    ]
    for name, r in runs.items():
        lines.append(
            f"  {name:<30}{r['num_ok']:>4}/{r['num_requests']:<4}{r['prefix_hit_rate']:>9.1%}"
            f"{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}"
            + (f"{r['simulated_ttft_p99_ms']:>9.0f}" if sim else "")
            + f"{r['tpot_p50_ms']:>10.1f}{r['output_tokens_per_s']:>10.0f}"
            f"{r['requests_per_s']:>7.2f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Bars per part: added latency; p99 TTFT and throughput per policy; hit rate and TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, dict[str, float], str]] = []
    if "overhead" in result:
        added = result["overhead"]["added_ms"]
        panels.append(("overhead: router - direct", added, "ms added"))
    if "balance" in result:
        runs = result["balance"]["policies"]
        panels.append(("balance: p99 TTFT", {k: v["ttft_p99_ms"] for k, v in runs.items()}, "ms"))
        tok = {k: v["output_tokens_per_s"] for k, v in runs.items()}
        panels.append(("balance: throughput", tok, "output tokens/s"))
    if "affinity" in result:
        runs = {k.replace(" --", "\n--"): v for k, v in result["affinity"]["runs"].items()}
        hit = {k: 100 * v["prefix_hit_rate"] for k, v in runs.items()}
        panels.append(("affinity: prefix-cache hits", hit, "% of prompt tokens"))
        panels.append(("affinity: p50 TTFT", {k: v["ttft_p50_ms"] for k, v in runs.items()}, "ms"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (title, values, unit) in zip(axes[0], panels, strict=True):
        ax.bar(range(len(values)), list(values.values()), color="tab:blue")
        ax.set_xticks(range(len(values)), list(values), fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
