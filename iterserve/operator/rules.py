"""The rules across an ``LLMDeployment`` spec's fields, one table for Python and CEL.

The server's own rules (:data:`iterserve.config.CROSS_FIELD_RULES`) on the settings the spec
sets, their fields renamed to the spec's paths (:data:`SETTING_PATHS`), then the operator's
own (:data:`OPERATOR_RULES`). The spec models check them in Python (:func:`rule_errors`) and
the CRD carries them as CEL rules (:mod:`iterserve.operator.crd`), with the same messages, so
``kubectl apply`` and ``iterserve operator render`` refuse the same specs.

A rule belongs to the deepest object of the spec that holds all of its fields
(:func:`rule_node`); as the API server does, it is not checked while that object is null
(``slaTiers`` not given: the server's default tiers, which pass every rule).
"""

from __future__ import annotations

from typing import Any

from iterserve.config import CROSS_FIELD_RULES, Rule

# Where the spec sets each server setting (the scheduler's live ones, and two engine flags
# the server's rules read): config field -> dotted path inside ``spec``.
SETTING_PATHS: dict[str, str] = {
    "max_num_seqs": "scheduler.maxNumSeqs",
    "max_num_batched_tokens": "scheduler.maxNumBatchedTokens",
    "long_prefill_token_threshold": "scheduler.chunkSize",
    "kv_watermark": "scheduler.kvWatermark",
    "preemption_mode": "scheduler.preemptionMode",
    "aging_interval_s": "scheduler.agingIntervalS",
    "priority_preemption_margin": "scheduler.priorityPreemptionMargin",
    "max_waiting": "scheduler.maxWaiting",
    "max_waiting_per_tenant": "scheduler.maxWaitingPerTenant",
    "tiers": "slaTiers",
    "swap_space": "engine.swapSpace",
    "max_model_len": "engine.maxModelLen",
    "quantization": "engine.quantization",
    "dtype": "engine.dtype",
}

_SOURCES = ("model.source.pvc", "model.source.hostPath", "model.source.image", "model.source.uri")
_KEDA = "{autoscaling.enabled} && {autoscaling.via} == 'keda'"

# Rules of the operator's own fields (the server has no such settings).
OPERATOR_RULES: tuple[Rule, ...] = (
    Rule(
        fields=_SOURCES,
        check=lambda *sources: sum(source is not None for source in sources) == 1,
        cel=" + ".join(f"(has({{{s}}}) ? 1 : 0)" for s in _SOURCES) + " == 1",
        message="give exactly one of " + ", ".join(f"{{{s}}}" for s in _SOURCES),
    ),
    Rule(
        fields=("model.source.uri", "model.source.initImage"),
        check=lambda uri, init_image: (uri is None) == (init_image is None),
        cel="has({model.source.uri}) == has({model.source.initImage})",
        message="{model.source.uri} and {model.source.initImage} go together",
    ),
    Rule(
        fields=("tensorParallelSize", "resources.gpus"),
        check=lambda tp, gpus: tp is None or gpus == 0 or gpus % tp == 0,
        cel="!has({tensorParallelSize}) || {resources.gpus} == 0"
        " || {resources.gpus} % {tensorParallelSize} == 0",
        message="{tensorParallelSize} must divide {resources.gpus}",
    ),
    Rule(
        fields=("engine.quantization", "resources.gpus"),
        check=lambda quantization, gpus: quantization == "none" or gpus == 0,
        cel="{engine.quantization} == 'none' || {resources.gpus} == 0",
        message="{engine.quantization} runs on CPU pods only today: {resources.gpus} must be 0",
    ),
    Rule(
        fields=("engine.kvCacheDtype", "resources.gpus"),
        check=lambda kv_cache_dtype, gpus: kv_cache_dtype == "auto" or gpus == 0,
        cel="{engine.kvCacheDtype} == 'auto' || {resources.gpus} == 0",
        message="{engine.kvCacheDtype} int8 runs on CPU pods only today: {resources.gpus} must "
        "be 0",
    ),
    Rule(
        fields=("slaTiers",),
        check=lambda tiers: len(tiers) > 0,
        cel="size({slaTiers}) > 0",
        message="{slaTiers}, when given, must not be empty",
    ),
    Rule(
        fields=("autoscaling.minReplicas", "autoscaling.maxReplicas"),
        check=lambda low, high: low <= high,
        cel="{autoscaling.minReplicas} <= {autoscaling.maxReplicas}",
        message="{autoscaling.minReplicas} must be <= {autoscaling.maxReplicas}",
    ),
    Rule(
        fields=("autoscaling.enabled", "autoscaling.via", "autoscaling.prometheusURL"),
        check=lambda enabled, via, url: not (enabled and via == "keda") or bool(url),
        cel=f"!({_KEDA}) || (has({{autoscaling.prometheusURL}})"
        " && size({autoscaling.prometheusURL}) > 0)",
        message="{autoscaling.via} keda needs {autoscaling.prometheusURL}",
    ),
    Rule(
        fields=("autoscaling.enabled", "autoscaling.via", "autoscaling.minReplicas"),
        check=lambda enabled, via, low: not (enabled and via == "hpa") or low >= 1,
        cel="!({autoscaling.enabled} && {autoscaling.via} == 'hpa')"
        " || {autoscaling.minReplicas} >= 1",
        message="{autoscaling.minReplicas} 0 (scale to zero) needs via keda",
    ),
    Rule(
        fields=(
            "router.replicas",
            "autoscaling.enabled",
            "autoscaling.via",
            "autoscaling.minReplicas",
        ),
        check=lambda replicas, enabled, via, low: (
            not (enabled and via == "keda" and low == 0) or replicas >= 1
        ),
        cel=f"!({_KEDA} && {{autoscaling.minReplicas}} == 0) || {{router.replicas}} >= 1",
        message="{autoscaling.minReplicas} 0 (scale to zero) needs {router.replicas} >= 1: the "
        "router's request rate wakes the server pods",
    ),
    Rule(
        fields=("router.kvEvents", "model.source.image", "model.source.uri"),
        check=lambda kv_events, image, uri: not kv_events or (image is None and uri is None),
        cel="!{router.kvEvents} || (!has({model.source.image}) && !has({model.source.uri}))",
        message="{router.kvEvents} needs the model's tokenizer in the router pods: weights on "
        "model.source.pvc or model.source.hostPath (mounted read-only there), not "
        "{model.source.image} or {model.source.uri}",
    ),
    Rule(
        fields=("router.mode", "networkPolicy.enabled", "networkPolicy.apiFrom"),
        check=lambda mode, enabled, namespaces: (
            mode != "endpointPicker" or not enabled or len(namespaces) > 0
        ),
        cel="{router.mode} != 'endpointPicker' || !{networkPolicy.enabled}"
        " || (has({networkPolicy.apiFrom}) && size({networkPolicy.apiFrom}) > 0)",
        message="{router.mode} endpointPicker with {networkPolicy.enabled} needs the gateway's "
        "namespace in {networkPolicy.apiFrom}: the gateway sends requests to the server pods "
        "and asks the picker",
    ),
)

# The server's rules that read only settings the spec sets (the others read flags it does
# not, such as enable_chunked_prefill), then the operator's.
SPEC_RULES: tuple[Rule, ...] = (
    *(
        rule.renamed(SETTING_PATHS)
        for rule in CROSS_FIELD_RULES
        if set(rule.fields) <= SETTING_PATHS.keys()
    ),
    *OPERATOR_RULES,
)


def rule_node(rule: Rule) -> tuple[str, ...]:
    """The path of the deepest spec object holding every field of ``rule`` (``()``: spec)."""
    paths = [tuple(name.split(".")) for name in rule.fields]
    node: tuple[str, ...] = ()
    for parts in zip(*paths, strict=False):
        if len(set(parts)) > 1:
            break
        node += (parts[0],)
    return node


def value_at(spec: Any, path: tuple[str, ...]) -> Any:
    """The value at ``path`` in a parsed spec (attribute names), None under a null object."""
    value = spec
    for name in path:
        if value is None:
            return None
        value = getattr(value, name)
    return value


def rule_errors(spec: Any) -> list[str]:
    """The messages of the :data:`SPEC_RULES` a parsed ``LLMDeploymentSpec`` breaks."""
    errors = []
    for rule in SPEC_RULES:
        if value_at(spec, rule_node(rule)) is None:
            continue
        values = {name: value_at(spec, tuple(name.split("."))) for name in rule.fields}
        if not rule.holds(values):
            errors.append(rule.explain())
    return errors
