"""The canary deploy gate: latency quantiles over a window from the pods' own Prometheus
histograms, canaries against baseline (docs/kubernetes.md, "A canary rollout").

A pod's histograms are cumulative since it started; the window is the difference between two
scrapes. Bucket counts are summed over the ``tier`` label and over the pods of a group, and the
quantile is what Prometheus's ``histogram_quantile`` computes from them: linear interpolation
inside the bucket that holds the rank, the first bucket starting at 0, a rank in the ``+Inf``
bucket answered with the largest finite bound. Everything here is pure (no I/O)::

    snapshot at start      snapshot now        window (delta)
    le=0.1: 40             le=0.1: 52          le=0.1: 12
    le=0.2: 45      ->     le=0.2: 70     ->   le=0.2: 25     -> quantile(0.99) ~ 0.2 s
    +Inf:   45             +Inf:   70          +Inf:   25
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

TTFT = "iterserve_time_to_first_token_seconds"
TPOT = "iterserve_request_time_per_output_token_seconds"
GATED = (TTFT, TPOT)
# Not a histogram: the live settings' hash the pod runs (its GET /load ``config_hash``), as
# ``{hash: 1.0}`` in a snapshot, whether a canary is on the change (rollout.scrape_pods).
CONFIG = "config_hash"

# A histogram's cumulative bucket counts by upper bound (``le``, as Prometheus writes it).
Buckets = dict[str, float]
# One pod's scrape: histogram name -> its buckets (summed over labels).
Snapshot = dict[str, Buckets]


def parse_snapshot(text: str, names: Iterable[str] = GATED) -> Snapshot:
    """The cumulative buckets of the histograms ``names`` in a ``/metrics`` page (Prometheus
    text format), summed over their labels; a histogram not on the page has no entry.

    Raises:
        ValueError: the page is not the text format, or a bucket's bound is not a number or
            its count not a finite count (what the gate could not compute on, or the status
            could not hold).
    """
    wanted = set(names)
    snapshot: Snapshot = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted or family.type != "histogram":
            continue
        buckets = snapshot.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name == family.name + "_bucket":
                le = sample.labels["le"]
                if math.isnan(float(le)) or not 0.0 <= sample.value < math.inf:
                    raise ValueError(f"not a histogram bucket: {sample}")
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return snapshot


def hash_of(snapshot: Snapshot | None) -> str | None:
    """The settings hash a scrape found (:data:`CONFIG`), None when it found none."""
    return next(iter((snapshot or {}).get(CONFIG) or {}), None)


def window(start: Buckets | None, now: Buckets) -> Buckets:
    """The counts observed between two scrapes of one pod. No start (a pod that began after
    the window did) is the whole of ``now``; a count that went down is a restarted pod
    (a counter reset, as Prometheus's ``increase`` treats it), whose counts are all new."""
    if start is None or any(now.get(le, 0.0) < num for le, num in start.items()):
        return dict(now)
    return {le: num - start.get(le, 0.0) for le, num in now.items()}


def add(total: Buckets, more: Mapping[str, float]) -> Buckets:
    """Bucket counts summed (over pods)."""
    out = dict(total)
    for le, num in more.items():
        out[le] = out.get(le, 0.0) + num
    return out


def count(buckets: Buckets) -> int:
    """Observations in ``buckets`` (the ``+Inf`` bucket)."""
    return int(buckets.get("+Inf", 0.0))


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's ``histogram_quantile(q, buckets)`` in seconds; None with no observation.

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted((float(le), c) for le, c in buckets.items())
    if not bounds or bounds[-1][0] != math.inf or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in bounds:
        if cumulative >= rank:
            if upper == math.inf:  # in the +Inf bucket: the largest finite bound
                return lower
            if cumulative == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


@dataclass(frozen=True)
class GateLimits:
    """The gate (spec.rollout): the most each quantile of the canaries may exceed the
    baseline's, in percent of the baseline's (20: up to 1.2 times), and the requests each
    group needs before it decides."""

    max_ttft_p99_regression_pct: float = 20.0
    max_tpot_p50_regression_pct: float = 15.0
    min_requests: int = 20


@dataclass(frozen=True)
class Figure:
    """One gated quantile in seconds, canaries and baseline, and the most the canaries' may
    exceed the baseline's, in percent of it."""

    name: str  # "TTFT p99", "TPOT p50"
    canary_s: float
    baseline_s: float
    max_regression_pct: float

    @property
    def ratio(self) -> float:
        if self.baseline_s > 0:
            return self.canary_s / self.baseline_s
        return 1.0 if self.canary_s <= 0 else math.inf

    @property
    def regression_pct(self) -> float:
        """How far the canaries' exceeds the baseline's, in percent (negative: faster)."""
        return (self.ratio - 1.0) * 100.0

    @property
    def within(self) -> bool:
        return self.ratio <= 1.0 + self.max_regression_pct / 100.0

    def text(self) -> str:
        """E.g. ``TTFT p99 0.412 s vs baseline 0.105 s (+292%, limit +20%)``."""
        return (
            f"{self.name} {self.canary_s:.3f} s vs baseline {self.baseline_s:.3f} s "
            f"({self.regression_pct:+.0f}%, limit +{self.max_regression_pct:g}%)"
        )


@dataclass(frozen=True)
class Verdict:
    """What the gate says of a window: ``enough`` when each group served ``min_requests``
    (requests with a first token, and requests with a TPOT); then ``figures``."""

    enough: bool
    canary_requests: int
    baseline_requests: int
    figures: tuple[Figure, ...] = ()

    @property
    def within(self) -> bool:
        return self.enough and all(f.within for f in self.figures)

    def text(self) -> str:
        if not self.enough:
            return (
                f"not enough traffic: canaries {self.canary_requests}, baseline "
                f"{self.baseline_requests} requests"
            )
        return "; ".join(f.text() for f in self.figures)


def judge(canary: Snapshot, baseline: Snapshot, limits: GateLimits) -> Verdict:
    """The gate on two groups' window buckets (:func:`window`, summed with :func:`add`)."""
    num_canary, num_baseline = (
        min(count(group.get(name, {})) for name in GATED) for group in (canary, baseline)
    )
    if min(num_canary, num_baseline) < limits.min_requests:
        return Verdict(False, num_canary, num_baseline)
    figures = []
    for name, q, label, limit_pct in (
        (TTFT, 0.99, "TTFT p99", limits.max_ttft_p99_regression_pct),
        (TPOT, 0.5, "TPOT p50", limits.max_tpot_p50_regression_pct),
    ):
        canary_s, baseline_s = quantile(q, canary[name]), quantile(q, baseline[name])
        assert canary_s is not None and baseline_s is not None  # counted above
        figures.append(Figure(label, canary_s, baseline_s, limit_pct))
    return Verdict(True, num_canary, num_baseline, tuple(figures))
