"""What a replay returns: per-request records, rejections, KV usage over time, and the report
``iterserve simulate`` writes (``bench serve``'s fields plus the simulator's own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.workload.stats import SLO, RequestRecord, distribution, summarize, summarize_by_tier

# KV usage samples kept per replica in the report (evenly thinned).
MAX_KV_SAMPLES = 400


@dataclass
class ReplayResult:
    """One candidate config's replay."""

    records: list[RequestRecord]
    queue_s: list[tuple[str, float]]  # (tier, queue time) of requests that were scheduled
    duration_s: float  # virtual: from 0 to the last response
    wall_s: float  # real time the replay took
    num_preemptions: int
    rejected: dict[str, int]  # reason -> count: 429s (queue_full, queue_wait) and 400s (invalid)
    kv_usage: list[list[tuple[float, float]]]  # per replica: (time, usage)
    num_iterations: int
    busy_s: float  # virtual seconds the replicas spent in iterations, all together

    def report(self, name: str, slo: SLO) -> dict[str, Any]:
        """``bench serve``'s fields (``summary``, ``by_tier``) plus the simulator's own."""
        summary = summarize(self.records, self.duration_s, slo)
        by_tier = summarize_by_tier(self.records, self.duration_s, slo)
        summary["queue_ms"] = _dist_ms([q for _, q in self.queue_s])
        for tier, tier_summary in by_tier.items():
            tier_summary["queue_ms"] = _dist_ms([q for t, q in self.queue_s if t == tier])
        return {
            "config": name,
            "summary": summary,
            "by_tier": by_tier,
            "num_preemptions": self.num_preemptions,
            "num_rejected": sum(self.rejected.values()),
            "rejected_by_reason": self.rejected,
            "num_iterations": self.num_iterations,
            "mean_iteration_ms": self.busy_s / max(1, self.num_iterations) * 1000,
            "wall_s": self.wall_s,
            "speedup_vs_real_time": self.duration_s / max(self.wall_s, 1e-9),
            "kv_usage": [_thin(series) for series in self.kv_usage],
        }


def _dist_ms(values: list[float]) -> dict[str, float]:
    return distribution([v * 1000 for v in values])


def _thin(series: list[tuple[float, float]]) -> list[tuple[float, float]]:
    step = max(1, len(series) // MAX_KV_SAMPLES)
    return series[::step]
