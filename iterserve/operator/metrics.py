"""The operator's own Prometheus metrics (``iterserve operator run --metrics-port``; the
series are listed in docs/observability.md, "The operator").

The handlers record what each reconcile found (:class:`~iterserve.operator.reconcile.Outcome`):
its outcome, how long the live-settings pushes took, how many ready pods do not run the
spec's settings, and how a canary rollout ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

disable_created_metrics()

# Reconcile outcomes: applied, the spec refused, the API failing or unreachable, a bug.
OUTCOMES = ("success", "invalid_spec", "api_error", "api_unreachable", "error")
ROLLOUT_OUTCOMES = ("promoted", "rolled_back", "unchecked")
# A push is a GET /load, and a PUT where the settings differ, to every pod at once: tens of
# milliseconds on a healthy fleet, up to --push-timeout-s (5 s) when a pod does not answer.
_GONE_KEPT = 10_000  # deleted resources remembered (uids: about 1 MB)
_PUSH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    """The operator's series on their own registry (with the process collector), each
    labelled by the resource (``namespace``, ``llmdeployment``: the chart's PodMonitor keeps
    them over the scrape's own ``namespace`` with ``honorLabels``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        resource = ["namespace", "llmdeployment"]
        self.reconciles = Counter(
            "iterserve_operator_reconciles",
            "Reconciles of an LLMDeployment, by outcome",
            [*resource, "outcome"],
            registry=r,
        )
        self.push_seconds = Histogram(
            "iterserve_operator_push_duration_seconds",
            "Seconds one reconcile's live-settings push took (every ready pod at once), "
            "observed when some pod was sent new settings",
            resource,
            buckets=_PUSH_BUCKETS,
            registry=r,
        )
        self.pods_behind = Gauge(
            "iterserve_operator_pods_not_at_desired_settings",
            "Ready server pods not running the spec's live settings (a canary bake, a "
            "rolled-back change, a pod the push missed)",
            resource,
            registry=r,
        )
        self.rollouts = Counter(
            "iterserve_operator_rollouts",
            "Canary rollouts of live settings that ended, by outcome",
            [*resource, "outcome"],
            registry=r,
        )
        self._known: set[tuple[str, str]] = set()
        # The uids of deleted resources (the last _GONE_KEPT): a reconcile that was in flight
        # when one was deleted must not create its series again.
        self._gone: dict[str, None] = {}

    def _resource(self, body: Mapping[str, Any]) -> tuple[str, str] | None:
        """The resource's labels; its outcome series created at 0 when first seen. None for
        a resource already deleted."""
        meta = body["metadata"]
        if meta.get("uid") in self._gone:
            return None
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if key not in self._known:
            self._known.add(key)
            for outcome in OUTCOMES:
                self.reconciles.labels(*key, outcome)
            for outcome in ROLLOUT_OUTCOMES:
                self.rollouts.labels(*key, outcome)
        return key

    def failed(self, body: Mapping[str, Any], outcome: str) -> None:
        """A reconcile of ``body`` that raised (``outcome``: one of :data:`OUTCOMES`)."""
        if (key := self._resource(body)) is not None:
            self.reconciles.labels(*key, outcome).inc()

    def record(
        self,
        body: Mapping[str, Any],
        push_s: float | None,
        num_pods_behind: int,
        rollout_outcome: str | None,
    ) -> None:
        """A successful reconcile of resource ``body`` (its
        :class:`~iterserve.operator.reconcile.Outcome`'s figures; seconds, pods)."""
        key = self._resource(body)
        if key is None:
            return
        self.reconciles.labels(*key, "success").inc()
        if push_s is not None:
            self.push_seconds.labels(*key).observe(push_s)
        self.pods_behind.labels(*key).set(num_pods_behind)
        if rollout_outcome is not None:
            self.rollouts.labels(*key, rollout_outcome).inc()

    def forget(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A deleted resource's series removed (series must not outlive their resource), and
        kept away from a reconcile of it still in flight (by ``uid``)."""
        key = (namespace, name)
        self._known.discard(key)
        if uid is not None:
            self._gone[uid] = None
            while len(self._gone) > _GONE_KEPT:
                del self._gone[next(iter(self._gone))]
        for family, outcomes in (
            (self.reconciles, OUTCOMES),
            (self.rollouts, ROLLOUT_OUTCOMES),
            (self.push_seconds, ((),)),
            (self.pods_behind, ((),)),
        ):
            for outcome in outcomes:
                labels = (*key, outcome) if isinstance(outcome, str) else key
                with contextlib.suppress(KeyError):
                    family.remove(*labels)

    def serve(self, host: str, port: int) -> WSGIServer:
        """``GET /metrics`` on ``host:port`` (a daemon thread); ``shutdown()`` stops it.

        Raises:
            OSError: the address is taken or not this host's.
        """
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server
