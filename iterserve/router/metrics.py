"""The router's Prometheus metrics (``iterserve_router_*``, docs/router.md), prometheus-client.

Most are the client library's own counters, updated where things happen. The KV-event index's
(``iterserve_router_kv_*``, with ``--kv-events-port``) are read from the index at each scrape
instead (:class:`KvIndexCollector`, a custom collector): the index keeps its own counters, and
a replica's ``iterserve_router_kv_blocks`` series goes away with the replica's entry in the
index (the subscriptions drop it when it leaves the set), with nothing to remove by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iterserve.router.retry import RETRY_REASONS

if TYPE_CHECKING:  # the index (and its msgpack) only with --kv-events-port
    from iterserve.router.kv_index import KvIndex

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

    def watch_kv_index(self, index: KvIndex) -> None:
        """Export ``index``'s counters and blocks (``iterserve_router_kv_*``) from now on."""
        self.registry.register(KvIndexCollector(index))


# The KV events' type names (kv_events' wire tags): their series exist at 0 from the start.
KV_EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class KvIndexCollector(Collector):
    """The KV-event index's counters and per-replica blocks, read at each scrape.

    Series (``p`` = ``iterserve_router_kv_``): ``p + batches_total``, ``p + events_total{type}``,
    ``p + malformed_total``, ``p + gaps_total``, ``p + unresolved_blocks_total``,
    ``p + overflows_total`` (all replicas together; see
    :class:`~iterserve.router.kv_index.IndexCounters`) and ``p + blocks{replica}`` (the
    distinct prompt blocks the index says a replica holds in its accelerator's KV cache).
    """

    def __init__(self, index: KvIndex) -> None:
        self.index = index

    def collect(self) -> Iterator[Metric]:
        p = "iterserve_router_kv_"
        c = self.index.counters
        yield CounterMetricFamily(p + "batches", "KV-event batches applied", value=c.batches)
        events = CounterMetricFamily(
            p + "events", "KV events applied, by type (vLLM's event names)", labels=["type"]
        )
        for kind in sorted({*KV_EVENT_TYPES, *c.events}):
            events.add_metric([kind], c.events.get(kind, 0))
        yield events
        for name, doc, value in (
            ("malformed", "KV-event messages ignored: they did not decode", c.malformed),
            ("gaps", "Sequence gaps or restarts that cleared a replica's blocks", c.gaps),
            ("unresolved_blocks", "Stored blocks skipped: parent never seen", c.unresolved),
            ("overflows", "Replicas cleared for holding too many blocks", c.overflows),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        blocks = GaugeMetricFamily(
            p + "blocks",
            "Prompt blocks a replica holds in its accelerator's KV cache, per its KV events",
            labels=["replica"],
        )
        for replica in sorted(self.index.replicas):
            blocks.add_metric([replica], self.index.num_blocks(replica))
        yield blocks
