"""The router's Prometheus metrics (``iterserve_router_*``, docs/router.md), prometheus-client."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from iterserve.router.retry import RETRY_REASONS

# No ``*_created`` series (as the server's).
disable_created_metrics()

# Seconds the router adds before a request leaves for its replica.
_OVERHEAD_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class RouterMetrics:
    """Every router metric, in its own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "iterserve_router_"
        self.requests = Counter(
            p + "requests",
            "Proxied requests by replica and status",
            ["replica", "code"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries", "Requests retried on another replica", ["reason"], registry=r
        )
        self.ejections = Counter(p + "ejections", "Replicas ejected", ["replica"], registry=r)
        self.picks = Counter(p + "picks", "Routing decisions", ["policy", "reason"], registry=r)
        self.proxy_overhead = Histogram(
            p + "proxy_overhead_seconds",
            "Arrival at the router to the request handed to its replica's connection "
            "(body read, parsed, picked; not the network hop, not the relay back)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.ready_replicas = Gauge(p + "ready_replicas", "Replicas receiving traffic", registry=r)
        self.held_requests = Gauge(
            p + "held_requests",
            "Requests waiting for a replica to turn ready (scale from zero)",
            registry=r,
        )
        self.served = Counter(
            p + "endpoint_served",
            "Endpoint picker: requests the gateway reports served (x-gateway-destination-"
            "endpoint-served), by replica and whether it was the pick or a fallback",
            ["replica", "picked"],
            registry=r,
        )
        for reason in RETRY_REASONS:
            self.retries.labels(reason=reason)
        # The 503 series exists at 0 from the start: Prometheus' rate() sees no increase in a
        # series' first sample, so the first "no ready replica" would not count in the rate
        # that wakes a deployment scaled to zero (docs/autoscaling.md).
        self.requests.labels(replica="none", code="503")
        self.requests.labels(replica="none", code="held")  # held for a replica to turn ready

    def forget_replica(self, name: str) -> None:
        """Remove every series of the replica ``name`` (it left the set: a replaced pod's
        series must not stay, or they grow with every rolling restart)."""
        for metric in (self.requests, self.ejections, self.served):
            metric.remove_by_labels({"replica": name})
