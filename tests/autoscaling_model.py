"""What a cluster's autoscaling does with scraped samples, as pure functions (for
tests/operator/test_autoscaling.py): Prometheus evaluating the queries the operator renders,
the HPA controller's algorithm, and KEDA's activation.

- **PromQL** (:func:`evaluate`): the few constructs the rendered queries and the
  prometheus-adapter rule use, over a parsed AST (``promql-parser``): instant vector
  selectors (the latest sample within the 5-minute lookback), ``rate()`` over a range
  (Prometheus' ``extrapolatedRate`` in promql/functions.go, as of Prometheus 3: samples in
  ``(t - range, t]``, extrapolated towards the range's ends, never before the counter's zero
  point), ``sum`` with or without ``by``, ``clamp_max``, ``vector()``, number literals, and
  between instant vectors ``or`` and ``+`` (one-to-one on identical label sets, no modifiers).
- **HPA** (:class:`Hpa`): the algorithm of "Horizontal Pod Autoscaling", "Algorithm
  details" (https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/
  #algorithm-details) and the controller's ``stabilizeRecommendationWithBehaviors`` and
  default scaling policies (pkg/controller/podautoscaler/horizontal.go):
  ``desiredReplicas = ceil(currentReplicas * currentMetricValue / desiredMetricValue)``
  (for a Pods metric, currentReplicas is the number of pods the metric was averaged over),
  no change while the ratio is within the tolerance (0.1) of 1, the largest proposal over
  the metrics, the stabilisation windows (scale down to the highest recommendation of the
  window, scale up to the lowest of its own, here 0 s: at once), the default rate limits
  (up: the larger of +4 pods and +100% per 15 s; down: 100% per 15 s) and the min/max clamp.
  Pods without metrics and not-ready pods (which dampen a proposal) are not modelled: every
  replica here reports.
- **KEDA** (:class:`Keda`): ScaledObject semantics (https://keda.sh/docs/latest/concepts/
  scaling-deployments/#activating-and-scaling-thresholds): each trigger is an External
  metric with an ``AverageValue`` target of its ``threshold`` on the HPA KEDA creates
  (proposal ``ceil(value / threshold)``); the ScaledObject is active while any trigger's
  value is *greater* than its ``activationThreshold``; at 0 replicas an active ScaledObject
  is scaled to ``max(1, minReplicaCount)``; with ``minReplicaCount: 0`` it goes back to 0
  once no trigger has been active for ``cooldownPeriod``.

Time is in seconds of cluster time; the tests compress it (one scrape = one sync period).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import promql_parser

Labels = frozenset[tuple[str, str]]
LOOKBACK_S = 300.0  # Prometheus' default --query.lookback-delta


def labels_of(**labels: str) -> Labels:
    return frozenset(labels.items())


@dataclass
class Store:
    """Scraped samples: series (its labels, ``__name__`` included) -> [(time s, value)]."""

    series: dict[Labels, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, t: float, name: str, labels: Mapping[str, str], value: float) -> None:
        key = frozenset({**labels, "__name__": name}.items())
        self.series.setdefault(key, []).append((t, value))


def _matches(labels: Labels, selector: promql_parser.VectorSelector) -> bool:
    have = dict(labels)
    if selector.name is not None and have.get("__name__") != selector.name:
        return False
    for m in selector.matchers.matchers:
        value, op = have.get(m.name, ""), str(m.op)
        if op in ("MatchOp.Equal", "MatchOp.NotEqual"):
            ok = value == m.value
        elif op in ("MatchOp.Re", "MatchOp.NotRe"):
            ok = re.fullmatch(m.value, value) is not None
        else:
            raise NotImplementedError(op)
        if ok == op.startswith("MatchOp.Not"):
            return False
    return True


def extrapolated_rate(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """``rate()`` of a counter's samples in ``(start, end]``, per second (at least two)."""
    (first_t, first_v), (last_t, last_v) = samples[0], samples[-1]
    delta = last_v - first_v
    for (_, before), (_, after) in itertools.pairwise(samples):
        if after < before:  # a counter reset: the counter went on from 0
            delta += before
    sampled = last_t - first_t
    average = sampled / (len(samples) - 1)
    threshold = average * 1.1
    to_start, to_end = first_t - start, end - last_t
    if to_start >= threshold:
        to_start = average / 2
    if delta > 0 and first_v >= 0:  # not before the counter's zero point
        to_start = min(to_start, sampled * first_v / delta)
    if to_end >= threshold:
        to_end = average / 2
    return delta * (sampled + to_start + to_end) / sampled / (end - start)


Vector = dict[Labels, float]


def evaluate(query: str, store: Store, t: float) -> Vector | float:
    """``query`` at time ``t`` over ``store``: an instant vector (labels -> value) or a
    scalar.

    Raises:
        NotImplementedError: a construct this model does not evaluate.
    """
    return _eval(promql_parser.parse(query), store, t)


def _eval(node: object, store: Store, t: float) -> Vector | float:
    if isinstance(node, promql_parser.NumberLiteral):
        return float(node.val)
    if isinstance(node, promql_parser.ParenExpr):
        return _eval(node.expr, store, t)
    if isinstance(node, promql_parser.VectorSelector):
        out: Vector = {}
        for labels, samples in store.series.items():
            recent = [v for ts, v in samples if t - LOOKBACK_S < ts <= t]
            if recent and _matches(labels, node):
                out[labels] = recent[-1]
        return out
    if isinstance(node, promql_parser.Call):
        return _call(node, store, t)
    if isinstance(node, promql_parser.BinaryExpr):
        return _binary(node, store, t)
    if isinstance(node, promql_parser.AggregateExpr):
        if str(node.op) != "sum":
            raise NotImplementedError(str(node.op))
        inner = _eval(node.expr, store, t)
        assert isinstance(inner, dict)
        by = list(node.modifier.labels) if node.modifier is not None else []
        if node.modifier is not None and "Without" in str(node.modifier.type):
            raise NotImplementedError("sum without")
        groups: Vector = {}
        for labels, value in inner.items():
            key = frozenset((k, v) for k, v in labels if k in by)
            groups[key] = groups.get(key, 0.0) + value
        return groups
    raise NotImplementedError(type(node).__name__)


def _binary(node: promql_parser.BinaryExpr, store: Store, t: float) -> Vector:
    """``a or b`` (``a``'s elements, then ``b``'s whose label sets ``a`` lacks) and ``a + b``
    (elements with the same label set in both, the metric name dropped: both sides here are
    aggregations, without one)."""
    # A set operator's modifier says ManyToMany; on(), ignoring(), group_*() and bool are not
    # modelled.
    if node.modifier is not None and (node.modifier.matching or node.modifier.return_bool):
        raise NotImplementedError("binary operator modifiers")
    lhs, rhs = _eval(node.lhs, store, t), _eval(node.rhs, store, t)
    if not isinstance(lhs, dict) or not isinstance(rhs, dict):
        raise NotImplementedError("scalar operands")
    op = str(node.op)
    if op == "or":
        return {**rhs, **lhs}
    if op == "+":
        return {k: v + rhs[k] for k, v in lhs.items() if k in rhs}
    raise NotImplementedError(op)


def _call(node: promql_parser.Call, store: Store, t: float) -> Vector:
    name = node.func.name
    if name == "rate":
        (matrix,) = node.args
        window = matrix.range.total_seconds()
        out: Vector = {}
        for labels, samples in store.series.items():
            inside = [(ts, v) for ts, v in samples if t - window < ts <= t]
            if len(inside) >= 2 and _matches(labels, matrix.vector_selector):
                rate = extrapolated_rate(inside, t - window, t)
                out[frozenset((k, v) for k, v in labels if k != "__name__")] = rate
        return out
    if name == "vector":
        (value,) = (_eval(a, store, t) for a in node.args)
        assert isinstance(value, float)
        return {frozenset(): value}
    if name == "clamp_max":
        vector, bound = (_eval(a, store, t) for a in node.args)
        assert isinstance(vector, dict) and isinstance(bound, float)
        return {k: min(v, bound) for k, v in vector.items()}
    raise NotImplementedError(name)


def scalar_of(result: Vector | float) -> float:
    """A KEDA trigger's value: the query's single element, 0 for an empty result (KEDA's
    ``ignoreNullValues``, on by default)."""
    if isinstance(result, float):
        return result
    if not result:
        return 0.0
    (value,) = result.values()
    return value


# --------------------------------------------------------------------------- HPA

TOLERANCE = 0.1
SYNC_PERIOD_S = 15.0  # kube-controller-manager --horizontal-pod-autoscaler-sync-period
POLICY_PERIOD_S = 15.0  # the default policies' periodSeconds


def _milli(value: float) -> int:
    """A metric value as the HPA reads it: a quantity's MilliValue (rounded up)."""
    return math.ceil(round(value * 1000, 6))


def pods_proposal(values: list[float], target: float, current: int) -> int:
    """A Pods metric with an ``AverageValue`` target: the replicas it asks for, given each
    reporting pod's value and the current replica count (replica_calculator.go's
    calcPlainMetricReplicas: milli-units, the average by integer division)."""
    average = sum(_milli(v) for v in values) // len(values)
    ratio = average / _milli(target)
    if abs(1.0 - ratio) <= TOLERANCE:
        return current
    return math.ceil(ratio * len(values))


def external_proposal(value: float, target: float, current: int) -> int:
    """An External metric with an ``AverageValue`` target (what KEDA's triggers are): the
    value is divided over the current replicas for the tolerance check
    (GetExternalPerPodMetricReplicas)."""
    usage, per_pod = _milli(value), _milli(target)
    if abs(1.0 - usage / (per_pod * current)) <= TOLERANCE:
        return current
    return math.ceil(usage / per_pod)


@dataclass
class Hpa:
    """One HorizontalPodAutoscaler's controller state; :meth:`step` once per sync period."""

    min_replicas: int
    max_replicas: int
    replicas: int
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    recommendations: list[tuple[float, int]] = field(default_factory=list)

    def step(self, now: float, proposals: list[int]) -> int:
        """The replica count after a sync at ``now`` whose metrics proposed ``proposals``."""
        desired = max(proposals)
        # Recommendations strictly inside each window, this one included (the controller's
        # timestamp.After(cutoff)).
        kept = [(t, r) for t, r in self.recommendations if t > now - self.scale_down_window_s]
        up = min([r for t, r in kept if t > now - self.scale_up_window_s] + [desired])
        down = max([r for _, r in kept] + [desired])
        self.recommendations = [*kept, (now, desired)]
        stabilized = min(max(self.replicas, up), down)
        # Default policies: up by the larger of 4 pods and 100% per period, down by 100%.
        limit_up = max(self.replicas + 4, 2 * self.replicas)
        self.replicas = max(self.min_replicas, min(stabilized, limit_up, self.max_replicas))
        return self.replicas


@dataclass
class Trigger:
    """One ScaledObject trigger's numbers (KEDA passes strings; the test parses them)."""

    threshold: float
    activation_threshold: float


@dataclass
class Keda:
    """A ScaledObject and the HPA KEDA creates for it; :meth:`step` once per sync period."""

    min_replicas: int
    max_replicas: int
    cooldown_s: float
    hpa: Hpa
    replicas: int = 0
    last_active: float | None = None

    @classmethod
    def of(cls, scaled_object: Mapping[str, object], replicas: int) -> Keda:
        spec = scaled_object["spec"]
        assert isinstance(spec, dict)
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = Hpa(
            min_replicas=max(1, spec["minReplicaCount"]),  # an HPA has at least 1
            max_replicas=spec["maxReplicaCount"],
            replicas=max(1, replicas),
            scale_up_window_s=behavior["scaleUp"]["stabilizationWindowSeconds"],
            scale_down_window_s=behavior["scaleDown"]["stabilizationWindowSeconds"],
        )
        return cls(
            spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"], hpa, replicas
        )

    def step(self, now: float, values: list[float], triggers: list[Trigger]) -> int:
        """The replica count after a sync at ``now`` whose triggers read ``values``."""
        active = self.min_replicas >= 1 or any(
            v > tr.activation_threshold for v, tr in zip(values, triggers, strict=True)
        )
        if active:
            self.last_active = now
        if self.replicas == 0:
            if active:  # KEDA's activation: 0 -> max(1, min), then the HPA
                self.replicas = self.hpa.replicas = max(1, self.min_replicas)
            return self.replicas
        if self.min_replicas == 0 and (
            self.last_active is None or now - self.last_active >= self.cooldown_s
        ):
            self.replicas = 0  # KEDA's deactivation after the cooldown
            self.hpa.recommendations.clear()
            return 0
        proposals = [
            external_proposal(v, tr.threshold, self.hpa.replicas)
            for v, tr in zip(values, triggers, strict=True)
        ]
        self.replicas = self.hpa.step(now, proposals)
        return self.replicas
