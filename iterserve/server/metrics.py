"""Prometheus metrics of a server replica (docs/server.md, "Metrics"), on prometheus-client.

Engine-side numbers (queue gauges, KV usage, token counters, preemptions, prefix-cache
lookups, iteration histograms) come from the per-iteration telemetry the engine process sends
with each message. Per-request latencies are measured here, where the client's tokens leave:
a :class:`RequestTracker` per engine request observes TTFT, inter-token gaps, TPOT, queue time
and end-to-end latency. A request with ``n > 1`` is one request in every per-request metric.
Per-tenant series (queue time, admission's rejections) carry a ``tenant`` label of bounded
cardinality (:class:`~iterserve.server.tenants.TenantLabels`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from iterserve.config import Tier
from iterserve.engine.messages import EngineLoad, IterationStats, RequestDelta
from iterserve.server.tenants import DEFAULT_TENANT, TenantLabels

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = tuple(2**i for i in range(14))
# The reasons of admission's refusals (:class:`~iterserve.server.admission.Rejected`).
ADMISSION_REASONS = ("queue_full", "queue_wait", "tenant_queue_full", "shutting_down")

# No ``*_created`` series: they double the exposition and no dashboard reads them.
disable_created_metrics()


class ServerMetrics:
    """Every metric of the replica, in its own registry (several apps may share a process).

    Args:
        tenant_label_limit: tenants that keep their name in the per-tenant series
            (``--tenant-label-limit``; later ones are ``other``).
    """

    def __init__(self, tenant_label_limit: int = 20) -> None:
        self.registry = CollectorRegistry()
        self.tenant_labels = TenantLabels(tenant_label_limit)
        self._tenant_series: set[str] = set()  # label values whose series exist
        self._add_gauges(self.registry)
        self._add_counters(self.registry)
        self._add_histograms(self.registry)
        self._create_series()

    def _add_gauges(self, r: CollectorRegistry) -> None:
        p = "iterserve_"
        self.num_running = Gauge(p + "num_requests_running", "Requests running", registry=r)
        self.num_waiting = Gauge(p + "num_requests_waiting", "Requests waiting", registry=r)
        self.num_swapped = Gauge(p + "num_requests_swapped", "Requests swapped out", registry=r)
        self.kv_usage = Gauge(
            p + "kv_cache_usage_ratio", "1 - free (incl. cached) / total KV blocks", registry=r
        )
        # The Gateway API Inference Extension's model-server protocol, under vLLM's names, so
        # InferencePool gateways and llm-d's endpoint picker route to iterserve unchanged.
        self.gie_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", registry=r)
        self.gie_running = Gauge("vllm:num_requests_running", "Requests running", registry=r)
        self.gie_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage, 0-1 (as vLLM reports it)", registry=r
        )
        self.gie_cache_config = Gauge(
            "vllm:cache_config_info",
            "KV cache geometry (value 1)",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )
        self.config_version = Gauge(
            p + "scheduler_config_version", "Version of the live scheduler settings", registry=r
        )
        # The alerting rule's side of "a tier's p99 queue wait over its limit": the limit is a
        # live setting, so it is exported rather than copied into the rule.
        self.tier_max_queue_wait = Gauge(
            p + "tier_max_queue_wait_seconds",
            "A tier's live max_queue_wait_ms, in seconds (no series for a tier without one)",
            ["tier"],
            registry=r,
        )

    def _add_counters(self, r: CollectorRegistry) -> None:
        p = "iterserve_"
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens computed (prefill)", registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Output tokens sampled", registry=r
        )
        self.preemptions = Counter(
            p + "num_preemptions", "Preemptions", ["mode", "reason"], registry=r
        )
        self.success = Counter(
            p + "request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.rejected = Counter(p + "requests_rejected", "Requests refused", ["reason"], registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.tenant_rejected = Counter(
            p + "tenant_requests_rejected",
            "Requests refused by admission (429/503)",
            ["tenant", "reason"],
            registry=r,
        )
        self.telemetry_dropped = Counter(
            p + "telemetry_records_dropped",
            "Telemetry rows dropped (the writer's queue was full, or a write failed)",
            ["table"],
            registry=r,
        )
        self.kv_events_dropped = Counter(
            p + "kv_events_dropped",
            "KV-event batches not published (the publisher's queue was full)",
            registry=r,
        )
        self._num_kv_events_dropped = 0  # the engine's total as of the last scrape

    def _add_histograms(self, r: CollectorRegistry) -> None:
        p = "iterserve_"

        def histogram(name: str, doc: str, labels: Iterable[str] = (), buckets: Any = None) -> Any:
            return Histogram(
                p + name, doc, list(labels), buckets=buckets or _LATENCY_BUCKETS, registry=r
            )

        self.ttft = histogram("time_to_first_token_seconds", "TTFT", ["tier"])
        self.tpot = histogram("request_time_per_output_token_seconds", "TPOT per request", ["tier"])
        self.itl = histogram("inter_token_latency_seconds", "Gap between a request's tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", ["tier"])
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first admission", ["tier"]
        )
        self.tenant_queue_time = histogram(
            "tenant_request_queue_time_seconds", "Arrival to first admission", ["tenant"]
        )
        self.iteration_latency = histogram("iteration_latency_seconds", "One engine iteration")
        self.iteration_tokens = histogram(
            "iteration_tokens", "Tokens of one iteration", ["phase"], _TOKEN_BUCKETS
        )

    def _create_series(self) -> None:
        """The labelled series that exist before their first event, at zero."""
        for mode in ("recompute", "swap"):
            for cause in ("kv", "priority"):
                self.preemptions.labels(mode=mode, reason=cause)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(finished_reason=reason)
        for reason in ("invalid", *ADMISSION_REASONS):
            self.rejected.labels(reason=reason)
        self.tenant_label(DEFAULT_TENANT)

    def tenant_label(self, tenant: str) -> str:
        """The ``tenant`` label value of ``tenant``; the first time a value is given out its
        series are created at zero (so ``rate()`` sees a tenant's first rejection)."""
        label = self.tenant_labels(tenant)
        if label not in self._tenant_series:
            self._tenant_series.add(label)
            self.tenant_queue_time.labels(tenant=label)
            for reason in ADMISSION_REASONS:
                self.tenant_rejected.labels(tenant=label, reason=reason)
        return label

    def count_rejection(self, reason: str, tenant: str) -> None:
        """One request refused by admission (``reason``: one of :data:`ADMISSION_REASONS`)."""
        self.rejected.labels(reason=reason).inc()
        self.tenant_rejected.labels(tenant=self.tenant_label(tenant), reason=reason).inc()

    def observe_tenant_queue_time(self, tenant: str, queue_time_s: float | None) -> None:
        """A request's queue time (seconds; None: unknown, nothing observed) under its
        tenant's label."""
        if queue_time_s is not None:
            self.tenant_queue_time.labels(tenant=self.tenant_label(tenant)).observe(queue_time_s)

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """``vllm:cache_config_info``: the pool's geometry, once at start."""
        self.gie_cache_config.labels(
            block_size=str(block_size), num_gpu_blocks=str(num_blocks)
        ).set(1)

    def set_settings(self, version: int, tiers: Iterable[Tier]) -> None:
        """The live settings' gauges, at start and after every applied change.

        Args:
            version: ``config_version`` of the settings in force.
            tiers: their SLA tiers; ``iterserve_tier_max_queue_wait_seconds{tier}`` is set for
                each tier with a ``max_queue_wait_ms`` (ms / 1000) and dropped for the others.
        """
        self.config_version.set(version)
        # clear() and the sets run without an await between them: no scrape sees a gap.
        self.tier_max_queue_wait.clear()
        for tier in tiers:
            if tier.max_queue_wait_ms is not None:
                self.tier_max_queue_wait.labels(tier=tier.name).set(tier.max_queue_wait_ms / 1000)

    def _count_preemptions(self, it: IterationStats) -> None:
        priority_swap = it.num_priority_swap_preemptions
        priority_recompute = it.num_priority_preemptions - priority_swap
        kv_swap = it.num_swap_preemptions - priority_swap
        kv_recompute = it.num_preemptions - it.num_priority_preemptions - kv_swap
        for mode, reason, n in (
            ("swap", "kv", kv_swap),
            ("recompute", "kv", kv_recompute),
            ("swap", "priority", priority_swap),
            ("recompute", "priority", priority_recompute),
        ):
            if n:
                self.preemptions.labels(mode=mode, reason=reason).inc(n)

    def set_load(self, load: EngineLoad) -> None:
        """Queue gauges from the engine's counts."""
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.num_swapped.set(load.num_swapped)
        self.kv_usage.set(load.kv_cache_usage)
        self.gie_running.set(load.num_running)
        self.gie_waiting.set(load.num_waiting)
        self.gie_kv_usage.set(load.kv_cache_usage)

    def set_kv_events_dropped(self, total: int) -> None:
        """Bring the counter up to the engine's running total of dropped KV-event batches."""
        if total > self._num_kv_events_dropped:
            self.kv_events_dropped.inc(total - self._num_kv_events_dropped)
            self._num_kv_events_dropped = total

    def observe_iterations(self, telemetry: list[IterationStats], load: EngineLoad) -> None:
        """Per-iteration telemetry records (called with each engine message)."""
        for it in telemetry:
            self.iteration_latency.observe(it.latency_s)
            if it.num_prefill_tokens:
                self.iteration_tokens.labels(phase="prefill").observe(it.num_prefill_tokens)
                self.prompt_tokens.inc(it.num_prefill_tokens)
            if it.num_decode_tokens:
                self.iteration_tokens.labels(phase="decode").observe(it.num_decode_tokens)
            self.generation_tokens.inc(it.num_generated_tokens)
            if it.num_preemptions:
                self._count_preemptions(it)
            self.prefix_queries.inc(it.num_prefix_cache_queries)
            self.prefix_hits.inc(it.num_prefix_cache_hits)
        self.set_load(load)


class RequestTracker:
    """Latency bookkeeping of one engine request, from acceptance to its end.

    Args:
        metrics: where to observe.
        tier: the tier label.
        arrival: when the HTTP request was accepted (seconds of ``clock``).
        clock: monotonic seconds (the engine's clock too: queue time compares the two).
    """

    def __init__(
        self, metrics: ServerMetrics, tier: str, arrival: float, clock: Any = time.monotonic
    ) -> None:
        self.metrics = metrics
        self.tier = tier
        self.clock = clock
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens_by_index: dict[int, int] = {}
        self.num_tokens = 0  # of the longest completion
        # Per-token gaps after the first token (a delta of k tokens after a gap g: k x g/k).
        self.token_gaps: list[float] = []
        self.queue_time_s: float | None = None  # arrival to first admission, once known
        self.done = False

    def on_delta(self, delta: RequestDelta) -> bool:
        """Observe a delta; True when it carried the request's first token."""
        counts = self.num_tokens_by_index
        for d in delta.completions:
            counts[d.index] = counts.get(d.index, 0) + len(d.new_token_ids)
        num_tokens = max(counts.values(), default=0)
        if num_tokens <= self.num_tokens:
            return False
        now = self.clock()
        first = self.first_token is None
        if first:
            self.first_token = now
            self.metrics.ttft.labels(tier=self.tier).observe(now - self.arrival)
            if delta.first_scheduled_time is not None:
                self.queue_time_s = max(0.0, delta.first_scheduled_time - self.arrival)
                self.metrics.queue_time.labels(tier=self.tier).observe(self.queue_time_s)
        elif self.last_token is not None:
            self.metrics.itl.observe(now - self.last_token)
            k = num_tokens - self.num_tokens
            self.token_gaps += [(now - self.last_token) / k] * k
        self.last_token = now
        self.num_tokens = num_tokens
        return first

    def finish(self, reason: str) -> None:
        """Count the request as finished with ``reason`` (stop/length/abort/error); once."""
        if self.done:
            return
        self.done = True
        self.metrics.success.labels(finished_reason=reason).inc()
        self.metrics.e2e.labels(tier=self.tier).observe(self.clock() - self.arrival)
        if self.num_tokens >= 2 and self.first_token is not None and self.last_token is not None:
            tpot = (self.last_token - self.first_token) / (self.num_tokens - 1)
            self.metrics.tpot.labels(tier=self.tier).observe(tpot)
