"""Checks table and timeline plot of ``benchmarks.overload`` and ``benchmarks.soak``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.reliability import Outcome

MIN_BIN_S = 5.0  # throughput bins of the timeline plot: at least this, at most 100 bins


def check(name: str, value: Any, bound: str, passed: bool) -> dict[str, Any]:
    """One row of a benchmark's verdict: what was measured, against what, and whether it held."""
    return {"check": name, "value": value, "bound": bound, "passed": bool(passed)}


def format_checks(checks: list[dict[str, Any]]) -> str:
    width = max(len(c["check"]) for c in checks)
    lines = [f"{'check':<{width}} {'value':>12} {'bound':>12}  verdict"]
    for c in checks:
        verdict = "ok" if c["passed"] else "FAILED"
        lines.append(f"{c['check']:<{width}} {c['value']!s:>12} {c['bound']:>12}  {verdict}")
    failed = [c["check"] for c in checks if not c["passed"]]
    lines.append("checks: " + (f"FAILED ({'; '.join(failed)})" if failed else "all passed"))
    return "\n".join(lines)


def _rate_bins(
    outcomes: list[Outcome], kind: str, end_s: float, bin_s: float
) -> tuple[list[float], list[float]]:
    """Requests of ``kind`` ending in each ``bin_s`` window, per second."""
    num_bins = max(1, int(end_s // bin_s) + 1)
    bins = [0] * num_bins
    for o in outcomes:
        if o.kind == kind and o.end_s is not None:
            bins[min(num_bins - 1, int(o.end_s // bin_s))] += 1
    return [(i + 0.5) * bin_s for i in range(num_bins)], [n / bin_s for n in bins]


def plot_timeline(
    samples: list[dict[str, Any]],
    outcomes: list[Outcome],
    marks_s: list[float],
    path: Path,
    title: str,
) -> Path:
    """RSS, KV blocks / running / waiting, and completed and rejected requests per second
    over the run; vertical lines at ``marks_s`` (phase starts, config changes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ts = [s["t_s"] for s in samples]
    axes[0].plot(ts, [s["rss_mib"] for s in samples], label="all server processes")
    if any(s["http_rss_mib"] != s["rss_mib"] for s in samples):
        axes[0].plot(ts, [s["http_rss_mib"] for s in samples], label="HTTP process")
        axes[0].set_yscale("log")
    axes[0].set_ylabel("server RSS (MiB)")
    axes[0].legend(fontsize=8)
    axes[1].plot(ts, [s["used_blocks"] for s in samples], label="used KV blocks")
    axes[1].plot(ts, [s["num_running"] for s in samples], label="running")
    axes[1].plot(ts, [s["num_waiting"] for s in samples], label="waiting")
    axes[1].set_ylabel("count")
    axes[1].legend(fontsize=8)
    end_s = max([*ts, *(o.end_s or 0.0 for o in outcomes)], default=0.0)
    bin_s = max(MIN_BIN_S, end_s / 100)
    for kind in ("completed", "rejected", "aborted", "failed"):
        xs, ys = _rate_bins(outcomes, kind, end_s, bin_s)
        if any(ys):
            axes[2].plot(xs, ys, label=kind)
    axes[2].set_ylabel(f"requests/s ({bin_s:g} s bins)")
    axes[2].set_xlabel("time (s)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
        for m in marks_s:
            ax.axvline(m, color="grey", alpha=0.4, linewidth=0.8)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
