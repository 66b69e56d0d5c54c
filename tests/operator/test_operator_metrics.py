"""The operator's /metrics (``iterserve operator run --metrics-port``): served, and counting
what the handlers see: reconciles by outcome, push durations, pods not at the desired
settings, rollouts by outcome."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import kopf
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import free_port

from iterserve.operator import handlers
from iterserve.operator.kube import Kube
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.reconcile import OperatorSettings, Outcome

BODY: dict[str, Any] = {
    "apiVersion": "iterserve.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
    "spec": {
        "model": {"name": "tiny", "source": {"hostPath": "/models/tiny"}},
        "image": "iterserve:test",
        "resources": {"gpus": 0},
    },
}


def _value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(
        name, {"namespace": "demo", "llmdeployment": "tiny", **labels}
    )


def test_served_with_every_series() -> None:
    metrics = OperatorMetrics()
    metrics.record(BODY, 0.03, 2, "rolled_back")
    server = metrics.serve("127.0.0.1", port := free_port())
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["iterserve_operator_reconciles"].type == "counter"
    assert families["iterserve_operator_push_duration_seconds"].type == "histogram"
    resource = {"namespace": "demo", "llmdeployment": "tiny"}
    (behind,) = families["iterserve_operator_pods_not_at_desired_settings"].samples
    assert (behind.labels, behind.value) == (resource, 2)
    outcomes = {
        s.labels.pop("outcome"): s.value
        for s in families["iterserve_operator_rollouts"].samples
        if s.name.endswith("_total") and s.labels == {**resource, "outcome": s.labels["outcome"]}
    }
    assert outcomes == {"promoted": 0, "rolled_back": 1, "unchecked": 0}
    assert "process_cpu_seconds" in families


class _Nothing(Kube):
    def __init__(self) -> None:
        pass


def test_the_handlers_count_each_reconcile(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = OperatorMetrics()
    memo = kopf.Memo(kube=_Nothing(), settings=OperatorSettings(), metrics=metrics)
    outcomes = iter([Outcome({"observedGeneration": 1}, [], 0.25, 1, "promoted")])

    async def fake_reconcile(kube: Any, body: Any, settings: Any) -> Outcome:
        return next(outcomes)

    monkeypatch.setattr(handlers, "reconcile", fake_reconcile)
    monkeypatch.setattr(kopf, "info", lambda *a, **k: None)
    asyncio.run(handlers._reconcile(BODY, kopf.Patch(), memo, permanent=False))  # type: ignore[arg-type]
    assert _value(metrics, "iterserve_operator_reconciles_total", outcome="success") == 1
    assert _value(metrics, "iterserve_operator_push_duration_seconds_count") == 1
    assert _value(metrics, "iterserve_operator_push_duration_seconds_sum") == 0.25
    assert _value(metrics, "iterserve_operator_pods_not_at_desired_settings") == 1
    assert _value(metrics, "iterserve_operator_rollouts_total", outcome="promoted") == 1
    monkeypatch.undo()  # the real reconcile: an invalid spec
    monkeypatch.setattr(kopf, "warn", lambda *a, **k: None)
    body = copy.deepcopy(BODY)
    body["spec"]["rollout"] = {"strategy": "sometimes"}
    with pytest.raises(kopf.PermanentError, match=r"spec\.rollout\.strategy"):
        asyncio.run(handlers._reconcile(body, kopf.Patch(), memo, permanent=True))  # type: ignore[arg-type]
    assert _value(metrics, "iterserve_operator_reconciles_total", outcome="invalid_spec") == 1
    assert _value(metrics, "iterserve_operator_reconciles_total", outcome="success") == 1
    metrics.forget("demo", "tiny")
    assert _value(metrics, "iterserve_operator_pods_not_at_desired_settings") is None
    assert _value(metrics, "iterserve_operator_reconciles_total", outcome="success") is None


def test_a_reconcile_that_ends_after_the_delete_does_not_bring_the_series_back() -> None:
    # Breaker finding: the resync timer's reconcile runs beside the delete handler; one that
    # ended after forget() re-created the deleted resource's series, for good (a leak per
    # resource created and deleted while a reconcile was in flight).
    metrics = OperatorMetrics()
    metrics.record(BODY, 0.1, 0, None)
    metrics.forget("demo", "tiny", "u")
    metrics.record(BODY, 0.1, 1, None)  # the in-flight reconcile of the deleted resource
    metrics.failed(BODY, "api_error")
    assert _value(metrics, "iterserve_operator_pods_not_at_desired_settings") is None
    assert _value(metrics, "iterserve_operator_reconciles_total", outcome="success") is None
    again = copy.deepcopy(BODY)  # created again under the same name: a new uid
    again["metadata"]["uid"] = "u2"
    metrics.record(again, None, 0, None)
    assert _value(metrics, "iterserve_operator_reconciles_total", outcome="success") == 1
