"""Serving statistics: per-request records, percentiles, goodput, and the latency gate.

Definitions (as vLLM's and SGLang's serving benchmarks):

- TTFT: send to first token received (seconds).
- ITL: gaps between consecutive received tokens of a request (every gap counted).
- TPOT: per request, (e2e - TTFT) / (output tokens - 1), for requests with >= 2 tokens.
- e2e: send to last byte.
- goodput: requests per second that succeeded and met the SLO (TTFT and TPOT limits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client observed of one request (times in seconds)."""

    ok: bool
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tier: str = "default"
    error: str | None = None
    status: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """A request meets the SLO when both limits hold (None: no limit)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile with linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and mean of ``values`` (NaN when empty)."""
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else math.nan
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """Throughput and latency distributions of a run (milliseconds for latencies).

    Args:
        records: one per request sent.
        duration_s: wall time from the first send to the last response.
        slo: for goodput.
    """
    ok = [r for r in records if r.ok]
    ms = 1000.0

    def dist(values: list[float | None]) -> dict[str, float]:
        return distribution([v * ms for v in values if v is not None])

    output_tokens = sum(r.output_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s,
        "requests_per_s": len(ok) / duration_s,
        "goodput_requests_per_s": sum(slo.met(r) for r in records) / duration_s,
        "ttft_ms": dist([r.ttft_s for r in ok]),
        "tpot_ms": dist([r.tpot_s for r in ok]),
        "itl_ms": dist([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": dist([r.e2e_s for r in ok]),
    }


def summarize_by_tier(
    records: list[RequestRecord], duration_s: float, slo: SLO
) -> dict[str, dict[str, Any]]:
    tiers = sorted({r.tier for r in records})
    return {t: summarize([r for r in records if r.tier == t], duration_s, slo) for t in tiers}


def cost_per_million_tokens(dollars_per_hour: float, output_tokens_per_s: float) -> float:
    """Dollars per 1M output tokens at a sustained rate (inf when nothing was produced)."""
    if output_tokens_per_s <= 0:
        return math.inf
    return dollars_per_hour / 3600 / output_tokens_per_s * 1e6


@dataclass(frozen=True)
class GateResult:
    metric: str
    baseline: float
    candidate: float
    limit: float  # allowed relative increase

    @property
    def change(self) -> float:
        if self.baseline <= 0:
            return 0.0 if self.candidate <= 0 else math.inf
        return self.candidate / self.baseline - 1

    @property
    def passed(self) -> bool:
        return self.change <= self.limit


def gate(
    baseline: dict[str, Any],
    candidate: dict[str, Any],
    max_ttft_p99_regression: float = 0.20,
    max_tpot_p50_regression: float = 0.15,
) -> list[GateResult]:
    """Compare two ``summarize`` results: p99 TTFT and p50 TPOT may grow by at most the
    given fractions."""
    return [
        GateResult(
            "ttft_ms.p99",
            baseline["ttft_ms"]["p99"],
            candidate["ttft_ms"]["p99"],
            max_ttft_p99_regression,
        ),
        GateResult(
            "tpot_ms.p50",
            baseline["tpot_ms"]["p50"],
            candidate["tpot_ms"]["p50"],
            max_tpot_p50_regression,
        ),
    ]
