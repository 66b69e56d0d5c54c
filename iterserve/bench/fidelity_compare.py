"""The comparisons of ``iterserve bench fidelity``: the simulator's figures against the real
server's, beside the real server's own run-to-run spread.

Each trace is replayed ``R`` times through the real server (``--repeat-real``) and once
through the simulator (deterministic). Per metric::

    measured     mean of the R real replays
    ratio        simulated / measured
    real spread  max / min - 1 over the R real replays (NaN for R = 1)
    verdict      ok           |ratio - 1| <= tolerance
                 miss         outside the tolerance and outside the real spread
                 noise        outside the tolerance but |ratio - 1| <= the real spread: the
                              machine's own run-to-run noise explains the miss
                 -            no target (TPOT p99, queue time: reported only)

Queue time is what each side reports: the simulator's exact arrival-to-first-admission times,
and the real server's ``iterserve_request_queue_time_seconds{tier}`` histogram (the
difference of two scrapes, quantiles interpolated within buckets as Prometheus's
``histogram_quantile``: coarse, hence no target). 429s are counted per tier on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from iterserve.workload.stats import RequestRecord

# (metric, key in a ``summarize`` dict, tolerance of simulated / measured; None: no target).
METRICS: tuple[tuple[str, tuple[str, ...], float | None], ...] = (
    ("output tok/s", ("output_tokens_per_s",), 0.15),
    ("TPOT p50", ("tpot_ms", "p50"), 0.15),
    ("TPOT p99", ("tpot_ms", "p99"), None),
    ("TTFT p50", ("ttft_ms", "p50"), 0.30),
    ("TTFT p99", ("ttft_ms", "p99"), 0.30),
    ("queue p50", ("queue_ms", "p50"), None),
    ("queue p99", ("queue_ms", "p99"), None),
)
QUEUE_METRIC = "iterserve_request_queue_time_seconds"


def _value(summary: dict[str, Any], key: tuple[str, ...]) -> float:
    value: Any = summary
    for k in key:
        if not isinstance(value, dict) or k not in value:
            return math.nan
        value = value[k]
    return float(value)


def spread(values: list[float]) -> float:
    """max / min - 1 of the finite values (NaN with fewer than two, inf when min is 0)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return math.nan
    low, high = min(finite), max(finite)
    if low <= 0:
        return 0.0 if high <= 0 else math.inf
    return high / low - 1


def verdict(ratio: float, tolerance: float | None, real_spread: float) -> str:
    """``ok``, ``miss``, ``noise`` or ``-`` (see the module docstring)."""
    if tolerance is None or not math.isfinite(ratio):
        return "-"
    error = abs(ratio - 1)
    if error <= tolerance:
        return "ok"
    return "noise" if math.isfinite(real_spread) and error <= real_spread else "miss"


def compare(sim: dict[str, Any], real: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric of :data:`METRICS`: ``sim`` (a ``summarize`` dict with
    ``queue_ms``) against the replays' ``real`` (one such dict per replay, at least one).

    Raises:
        ValueError: no real replay.
    """
    if not real:
        raise ValueError("compare needs at least one real replay")
    rows = []
    for name, key, tolerance in METRICS:
        s = _value(sim, key)
        runs = [_value(r, key) for r in real]
        finite = [v for v in runs if math.isfinite(v)]
        measured = sum(finite) / len(finite) if finite else math.nan
        ratio = s / measured if measured > 0 and math.isfinite(s) else math.nan
        real_spread = spread(runs)
        rows.append(
            {
                "metric": name,
                "simulated": s,
                "measured": measured,
                "measured_runs": runs,
                "ratio": ratio,
                "real_spread": real_spread,
                "tolerance": tolerance,
                "verdict": verdict(ratio, tolerance, real_spread),
            }
        )
    return rows


def compare_by_tier(
    sim: dict[str, dict[str, Any]], real: list[dict[str, dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """:func:`compare` per tier, over the tiers of the simulation and every replay (a tier
    missing from one side compares against an empty summary: NaN ratios)."""
    tiers = sorted(set(sim).union(*real))
    return {t: compare(sim.get(t, {}), [r.get(t, {}) for r in real]) for t in tiers}


def rejections_by_tier(records: Iterable[RequestRecord]) -> dict[str, int]:
    """429s per tier (tier as ``bench serve`` labels it)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.status == 429:
            counts[r.tier] = counts.get(r.tier, 0) + 1
    return counts


def queue_buckets(metrics_text: str) -> dict[str, dict[float, float]]:
    """The real server's queue-time histogram from a ``/metrics`` scrape: tier -> upper
    bound (seconds, ``inf`` for ``+Inf``) -> cumulative count."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != QUEUE_METRIC:
            continue
        for sample in family.samples:
            if sample.name == QUEUE_METRIC + "_bucket":
                tier = sample.labels.get("tier", "")
                out.setdefault(tier, {})[float(sample.labels["le"])] = sample.value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile``: the ``q`` quantile (0-1) of cumulative ``buckets``
    (upper bound -> count), linear within the bucket it falls in; the largest finite bound
    when it falls in ``+Inf``; NaN without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    low_bound, low_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return low_bound
            if count == low_count:
                return bound
            return low_bound + (bound - low_bound) * (rank - low_count) / (count - low_count)
        low_bound, low_count = bound, count
    return low_bound


def queue_ms(
    before: dict[str, dict[float, float]],
    after: dict[str, dict[float, float]],
    tiers: Iterable[str] | None = None,
) -> dict[str, float]:
    """p50 and p99 queue time (ms) of the observations between two scrapes, over ``tiers``
    (server tier labels; None: all) summed."""
    total: dict[float, float] = {}
    for tier, buckets in after.items():
        if tiers is not None and tier not in tiers:
            continue
        for bound, count in buckets.items():
            total[bound] = total.get(bound, 0.0) + count - before.get(tier, {}).get(bound, 0.0)
    n = total.get(math.inf, 0.0)
    return {
        "p50": histogram_quantile(0.5, total) * 1000,
        "p99": histogram_quantile(0.99, total) * 1000,
        "count": n,
    }


def _fmt(value: float) -> str:
    return f"{value:>10.1f}" if math.isfinite(value) else f"{'-':>10}"


def format_rows(rows: list[dict[str, Any]], indent: str = "  ") -> list[str]:
    """The comparison table's lines: metric, measured (mean), simulated, ratio, real spread,
    target and verdict."""
    lines = [
        f"{indent}{'metric':<14}{'measured':>10}{'simulated':>10}{'sim/real':>9}"
        f"{'real spread':>12}  target  verdict"
    ]
    for row in rows:
        ratio = f"{row['ratio']:>9.2f}" if math.isfinite(row["ratio"]) else f"{'-':>9}"
        s = row["real_spread"]
        real_spread = f"{s:>12.0%}" if math.isfinite(s) else f"{'-':>12}"
        target = f"+-{row['tolerance']:.0%}" if row["tolerance"] is not None else "-"
        lines.append(
            f"{indent}{row['metric']:<14}{_fmt(row['measured'])}{_fmt(row['simulated'])}"
            f"{ratio}{real_spread}  {target:<6}  {row['verdict']}"
        )
    return lines


def format_rejections(measured: list[dict[str, int]], simulated: dict[str, int]) -> str:
    """``429s per tier: premium real 0/1 sim 2, ...`` (one count per real replay)."""
    tiers = sorted(set(simulated).union(*measured))
    if not tiers:
        return "  429s: none (real and simulated)"
    parts = [
        f"{t} real {'/'.join(str(m.get(t, 0)) for m in measured)} sim {simulated.get(t, 0)}"
        for t in tiers
    ]
    return "  429s per tier: " + ", ".join(parts)
