"""The generated CRD: current on disk, structural, a valid CustomResourceDefinition, and its
OpenAPI schema and CEL rules agreeing with the spec models on the reference example and on
one broken variant per rule.

The API server is played by three helpers: defaulting as it does it (before validation),
the OpenAPI schema checked with ``jsonschema`` (unknown fields refused, as kubectl's strict
field validation does) and the CEL rules evaluated with ``celpy`` (null fields absent).
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from celpy import celtypes
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.config import CROSS_FIELD_RULES
from iterserve.operator.crd import CRD_FILE, RULES, build_crd, description_text, render_yaml
from iterserve.operator.rules import OPERATOR_RULES, SETTING_PATHS, SPEC_RULES
from iterserve.operator.spec import LLMDeploymentSpec, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((Path(__file__).parent / "examples" / "chat-70b.yaml").read_text())
MINIMAL = {
    "apiVersion": "iterserve.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "tiny", "namespace": "demo"},
    "spec": {
        "model": {"name": "tiny", "source": {"hostPath": "/models/tiny"}},
        "image": "ghcr.io/example/iterserve:0.2.0",
    },
}
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
ALL_MESSAGES = {rule["message"] for rules in RULES.values() for rule in rules}


# -- the API server's parts, played here ---------------------------------------------------


def schema_nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node under ``node`` (itself included), with its path."""
    nodes = [(path or ".", node)]
    for name, sub in node.get("properties", {}).items():
        nodes += schema_nodes(sub, f"{path}.{name}")
    if "items" in node:
        nodes += schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        nodes += schema_nodes(node["additionalProperties"], f"{path}{{}}")
    return nodes


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema (2020-12) of an OpenAPI v3 structural schema node."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if out.pop("nullable", False):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        else:  # int-or-string: `anyOf: [{type: integer}, {type: string}]`
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    for side in ("minimum", "maximum"):
        exclusive = f"exclusive{side.title()}"
        if out.pop(exclusive, False):
            out[exclusive] = out.pop(side)
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    return out


VALIDATOR = jsonschema.Draft202012Validator(to_json_schema(SCHEMA))


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in, recursively (in place)."""
    if isinstance(value, dict) and "properties" in node:
        for name, sub in node["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if value.get(name) is not None:
                apply_defaults(sub, value[name])
    elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        for item in value.values():
            apply_defaults(node["additionalProperties"], item)
    elif isinstance(value, list) and "items" in node:
        for item in value:
            apply_defaults(node["items"], item)
    return value


def to_cel(node: dict[str, Any], value: Any) -> Any:
    """``value`` as the API server hands it to CEL: typed by the schema (a number is a
    double even when written as an integer, an int-or-string one or the other), null fields
    of an object absent."""
    if node.get("x-kubernetes-int-or-string"):
        return celtypes.IntType(value) if isinstance(value, int) else celtypes.StringType(value)
    kind = node["type"]
    if kind == "object" and "properties" in node:
        return celtypes.MapType(
            {
                celtypes.StringType(k): to_cel(node["properties"][k], v)
                for k, v in value.items()
                if v is not None
            }
        )
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        sub = node["additionalProperties"]
        return celtypes.MapType({celtypes.StringType(k): to_cel(sub, v) for k, v in value.items()})
    if kind == "object":
        return celpy.json_to_cel(value)
    if kind == "array":
        return celtypes.ListType([to_cel(node["items"], v) for v in value])
    scalar = {
        "string": celtypes.StringType,
        "integer": celtypes.IntType,
        "number": celtypes.DoubleType,
        "boolean": celtypes.BoolType,
    }
    return scalar[kind](value)


@functools.cache
def cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_failures(node: dict[str, Any], value: Any) -> tuple[int, list[str]]:
    """(how many rules ran, the messages of those that refused ``value``). As the API
    server does, rules do not run on an absent or null value."""
    if value is None:
        return 0, []
    num_run, failed = 0, []
    for rule in node.get("x-kubernetes-validations", []):
        result = cel_program(rule["rule"]).evaluate({"self": to_cel(node, value)})
        assert isinstance(result, celtypes.BoolType), (rule["rule"], result)  # no CEL error
        num_run += 1
        if not result:
            failed.append(rule["message"])
    children: list[tuple[dict[str, Any], Any]] = []
    if isinstance(value, dict) and "properties" in node:
        children = [(node["properties"][k], v) for k, v in value.items()]
    elif isinstance(value, list):
        children = [(node["items"], v) for v in value]
    for sub, item in children:
        sub_run, sub_failed = cel_failures(sub, item)
        num_run, failed = num_run + sub_run, failed + sub_failed
    return num_run, failed


def admit(resource: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What the API server makes of ``resource``: (defaulted, CEL messages refusing it).
    Fails the test on a schema error (every case here is schema-valid)."""
    defaulted = apply_defaults(SCHEMA, copy.deepcopy(resource))
    VALIDATOR.validate(defaulted)
    VALIDATOR.validate(resource)
    return defaulted, cel_failures(SPEC_SCHEMA, defaulted["spec"])[1]


def python_errors(spec: dict[str, Any]) -> list[str]:
    """The spec models' reasons to refuse ``spec``, without locations or details."""
    try:
        parse_spec(spec)
    except SpecError as e:
        return [re.sub(r"^spec\.[\w.]+: ", "", m) for m in str(e).split("; ")]
    return []


def patched(resource: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``resource`` with ``spec``'s dotted paths set (``DELETE``: removed)."""
    out = copy.deepcopy(resource)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = out["spec"]
        for name in parents:
            node = node[name]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return out


DELETE = object()


# -- the manifest --------------------------------------------------------------------------


def test_committed_yaml_is_the_generators_output() -> None:
    committed = (ROOT / CRD_FILE).read_text()
    assert committed == render_yaml(), f"stale: run python -m iterserve.operator.crd > {CRD_FILE}"
    assert committed.startswith("# Generated")
    assert yaml.safe_load(committed) == build_crd()


def test_module_prints_the_yaml() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "iterserve.operator.crd"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == render_yaml()


def test_names_subresources_and_columns() -> None:
    crd = build_crd()
    assert crd["metadata"]["name"] == "llmdeployments.iterserve.io"
    spec = crd["spec"]
    assert spec["group"] == "iterserve.io"
    assert spec["names"]["shortNames"] == ["llmd"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: (c["type"], c["jsonPath"]) for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Ready", "Replicas", "Config", "Applied", "Age"]
    assert columns["Age"] == ("date", ".metadata.creationTimestamp")
    status = SCHEMA["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True  # kopf's bookkeeping
    assert status["properties"]["podConfigVersions"]["additionalProperties"]["type"] == "integer"


@pytest.mark.parametrize("k8s_version", ["1.33.0", "1.35.0"])
def test_is_a_valid_custom_resource_definition(k8s_version: str) -> None:
    assert kubernetes_validate.validate(build_crd(), k8s_version, strict=True)


def test_schema_is_structural() -> None:
    nodes = schema_nodes(SCHEMA)
    assert len(nodes) > 80
    int_or_string = [path for path, node in nodes if node.get("x-kubernetes-int-or-string")]
    assert int_or_string == [
        ".spec.resources.cpu",
        ".spec.resources.memory",
    ]
    for path, node in nodes:
        if node.get("x-kubernetes-int-or-string"):  # no type; the one anyOf allowed
            assert "type" not in node, path
            assert node.pop("anyOf") == [{"type": "integer"}, {"type": "string"}], path
            node = {**node, "type": "int-or-string"}
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title"} & set(node), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties", {}) is not False, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, path  # OpenAPI v3: a flag
        if node.get("type") == "object" and "properties" not in node and path != ".metadata":
            assert "additionalProperties" in node or node["x-kubernetes-preserve-unknown-fields"]


def descriptions(value: Any) -> set[str]:
    """Every ``description`` value anywhere in a JSON-schema document."""
    if isinstance(value, dict):
        found = {value["description"]} if isinstance(value.get("description"), str) else set()
        return found.union(*(descriptions(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(descriptions(v) for v in value))
    return set()


def test_keeps_every_description_of_the_models() -> None:
    """Fields' and model classes' descriptions alike (a field of a model type gets both)."""
    wanted = descriptions(LLMDeploymentSpec.model_json_schema(by_alias=True))
    assert len(wanted) > 50
    kept = descriptions(SPEC_SCHEMA)
    missing = [d for d in wanted if not any(description_text(d) in k for k in kept)]
    assert missing == []


def test_every_field_is_explained() -> None:
    """What ``kubectl explain llmdeployment.spec...`` shows: every field of the spec has a
    description, and each of the spec's sections says whether a change is pushed live or
    restarts pods."""
    for path, node in schema_nodes(SPEC_SCHEMA):
        if path.endswith(("[]", "{}")):  # a list's items or a map's values: the field's text
            continue
        assert node.get("description"), path
        assert "\n" not in node["description"].replace("\n\n", ""), path  # folded lines
    sections = SPEC_SCHEMA["properties"]
    for name in ("scheduler", "slaTiers"):
        assert "no restart" in sections[name]["description"], name
    for name in ("model", "image", "resources", "tensorParallelSize", "pod", "engine"):
        assert "rolls the server pods" in sections[name]["description"], name
    assert "rolls the router pods only" in sections["router"]["description"]
    assert "without restarting pods" in sections["replicas"]["description"]
    assert "restarts no pod" in sections["autoscaling"]["description"]


def test_free_form_and_string_maps() -> None:
    pod = SPEC_SCHEMA["properties"]["pod"]["properties"]
    for name in ("tolerations", "imagePullSecrets", "env"):
        assert pod[name]["items"] == {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
        }
    assert pod["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    for name in ("nodeSelector", "annotations", "labels"):
        assert pod[name]["additionalProperties"] == {"type": "string"}


# -- the schema and the models agree -------------------------------------------------------


@pytest.mark.parametrize("resource", [EXAMPLE, MINIMAL], ids=["chat-70b", "minimal"])
def test_examples_are_valid_and_defaults_agree(resource: dict[str, Any]) -> None:
    defaulted, failures = admit(resource)
    assert failures == []
    assert python_errors(resource["spec"]) == []
    # The API server's defaults are the models' defaults.
    assert parse_spec(defaulted["spec"]) == parse_spec(resource["spec"])
    model_dump = parse_spec(resource["spec"]).model_dump()
    assert without_empties(defaulted["spec"]) == without_empties(model_dump)


def without_empties(value: Any) -> Any:
    """``value`` without null values and empty maps or lists, recursively."""
    if isinstance(value, dict):
        items = {k: without_empties(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [without_empties(v) for v in value]
    return value


def test_minimal_gets_every_default_filled() -> None:
    spec = admit(MINIMAL)[0]["spec"]
    assert spec["scheduler"]["maxNumBatchedTokens"] == 2048
    assert spec["autoscaling"] == {
        "enabled": False,
        "via": "hpa",
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueueDepth": 8,
    }
    assert spec["pod"] == {}


def test_every_rule_runs_on_the_example() -> None:
    num_run, failed = cel_failures(SPEC_SCHEMA, admit(EXAMPLE)[0]["spec"])
    assert (num_run, failed) == (sum(len(r) for r in RULES.values()), [])


TIERS_DUP_NAME = [{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]
TIERS_DUP_PRIORITY = [{"name": "a", "priority": 0}, {"name": "b", "priority": 0}]
ONE_SOURCE = (
    "give exactly one of model.source.pvc, model.source.hostPath, model.source.image, "
    "model.source.uri"
)
KEDA = {"enabled": True, "via": "keda", "minReplicas": 0, "maxReplicas": 4}

# (id, changes to the example's spec, the messages both the CEL rules and the models give)
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("batched-below-seqs", {"scheduler.maxNumSeqs": 4096},
     ["scheduler.maxNumBatchedTokens must be >= scheduler.maxNumSeqs: every running request "
      "needs a decode token"]),
    ("chunk-above-batched", {"scheduler.chunkSize": 4096},
     ["scheduler.chunkSize must be <= scheduler.maxNumBatchedTokens"]),
    ("per-tenant-above-max", {"scheduler.maxWaitingPerTenant": 2048},
     ["scheduler.maxWaitingPerTenant must be <= scheduler.maxWaiting"]),
    ("tp-not-dividing", {"tensorParallelSize": 3},
     ["tensorParallelSize must divide resources.gpus"]),
    ("swap-without-space", {"scheduler.preemptionMode": "swap", "engine.swapSpace": 0},
     ["scheduler.preemptionMode swap needs swap space: engine.swapSpace > 0"]),
    ("tier-names", {"slaTiers": TIERS_DUP_NAME}, ["tier names must be unique in slaTiers"]),
    ("tier-priorities", {"slaTiers": TIERS_DUP_PRIORITY},
     ["tier priorities must be unique in slaTiers"]),
    ("tiers-empty", {"slaTiers": []}, ["slaTiers, when given, must not be empty"]),
    ("min-above-max", {"autoscaling.minReplicas": 5},
     ["autoscaling.minReplicas must be <= autoscaling.maxReplicas"]),
    ("keda-without-url", {"autoscaling": KEDA},
     ["autoscaling.via keda needs autoscaling.prometheusURL"]),
    ("keda-empty-url", {"autoscaling": {**KEDA, "prometheusURL": ""}},
     ["autoscaling.via keda needs autoscaling.prometheusURL"]),
    ("hpa-to-zero", {"autoscaling.enabled": True, "autoscaling.minReplicas": 0},
     ["autoscaling.minReplicas 0 (scale to zero) needs via keda"]),
    ("keda-to-zero-without-router",
     {"autoscaling": {**KEDA, "prometheusURL": "http://prometheus:9090"}, "router.replicas": 0},
     ["autoscaling.minReplicas 0 (scale to zero) needs router.replicas >= 1: the router's "
      "request rate wakes the server pods"]),
    ("two-sources", {"model.source.hostPath": "/models/llama"},
     [ONE_SOURCE]),
    ("no-source", {"model.source": {}}, [ONE_SOURCE]),
    ("uri-without-init", {"model.source": {"uri": "s3://bucket/llama"}},
     ["model.source.uri and model.source.initImage go together"]),
    ("init-without-uri", {"model.source.initImage": "ghcr.io/example/fetch:1"},
     ["model.source.uri and model.source.initImage go together"]),
    ("picker-without-gateway-namespace",
     {"router.mode": "endpointPicker"},
     ["router.mode endpointPicker with networkPolicy.enabled needs the gateway's namespace in "
      "networkPolicy.apiFrom: the gateway sends requests to the server pods and asks the "
      "picker"]),
    ("kv-events-weights-in-image",
     {"router.kvEvents": True, "model.source": {"image": {"path": "/opt/models/llama"}}},
     ["router.kvEvents needs the model's tokenizer in the router pods: weights on "
      "model.source.pvc or model.source.hostPath (mounted read-only there), not "
      "model.source.image or model.source.uri"]),
    ("quantization-on-gpus", {"engine.quantization": "int8"},
     ["engine.quantization runs on CPU pods only today: resources.gpus must be 0"]),
    ("int8-kv-cache-on-gpus", {"engine.kvCacheDtype": "int8"},
     ["engine.kvCacheDtype int8 runs on CPU pods only today: resources.gpus must be 0"]),
    ("quantization-in-float32",
     {"engine.quantization": "q4", "engine.dtype": "float32", "resources.gpus": 0},
     ["engine.quantization computes in bfloat16: engine.dtype must be auto or bfloat16"]),
    ("two-rules", {"scheduler.chunkSize": 4096, "autoscaling.minReplicas": 5},
     ["scheduler.chunkSize must be <= scheduler.maxNumBatchedTokens",
      "autoscaling.minReplicas must be <= autoscaling.maxReplicas"]),
    # Allowed near misses.
    ("tp-on-cpu", {"resources.gpus": 0, "tensorParallelSize": 3}, []),
    ("quantization-on-cpu", {"engine.quantization": "int8", "resources.gpus": 0}, []),
    ("int8-kv-cache-on-cpu", {"engine.kvCacheDtype": "int8", "resources.gpus": 0}, []),
    ("tp-default", {"tensorParallelSize": DELETE, "resources.gpus": 3}, []),
    ("tp-null", {"tensorParallelSize": None}, []),
    ("swap-with-space", {"scheduler.preemptionMode": "swap", "engine.swapSpace": 0.5}, []),
    ("no-chunk-cap", {"scheduler.chunkSize": 0}, []),
    ("per-tenant-at-max", {"scheduler.maxWaitingPerTenant": 1024}, []),
    ("per-tenant-absent", {"scheduler.maxWaitingPerTenant": DELETE}, []),
    ("default-tiers", {"slaTiers": DELETE}, []),
    ("null-tiers", {"slaTiers": None}, []),
    ("keda-to-zero", {"autoscaling": {**KEDA, "prometheusURL": "http://prometheus:9090"}}, []),
    ("hpa-off-at-zero", {"autoscaling.minReplicas": 0}, []),
    ("keda-from-one-without-router",
     {"autoscaling": {**KEDA, "minReplicas": 1, "prometheusURL": "http://p:9090"},
      "router.replicas": 0}, []),
    ("keda-off-at-zero-without-router",
     {"autoscaling": {**KEDA, "enabled": False}, "router.replicas": 0}, []),
    ("uri-with-init", {"model.source": {"uri": "s3://b/l", "initImage": "fetch:1"}}, []),
    ("image-source", {"model.source": {"image": {"path": "/opt/models/llama"}, "pvc": None}}, []),
    ("host-path", {"model.source": {"hostPath": "/models/llama"}}, []),
    ("kv-events-on-a-pvc", {"router.kvEvents": True}, []),
    ("picker-with-gateway-namespace",
     {"router.mode": "endpointPicker", "networkPolicy": {"apiFrom": ["gateway"]}}, []),
    ("picker-without-policies",
     {"router.mode": "endpointPicker", "networkPolicy": {"enabled": False}}, []),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cel_rules_and_models_agree(changes: dict[str, Any], expected: list[str]) -> None:
    resource = patched(EXAMPLE, changes)
    _, failures = admit(resource)
    assert sorted(failures) == sorted(expected)
    assert sorted(python_errors(resource["spec"])) == sorted(expected)


def test_every_rule_has_a_case_that_breaks_it() -> None:
    broken = {message for _, _, messages in CASES for message in messages}
    assert broken == ALL_MESSAGES


def test_the_rules_are_the_servers_and_the_operators() -> None:
    """Every server rule on settings the spec sets is in the CRD; those left out read a flag
    the spec does not set, or the tensor-parallel degree (optional in the spec: resolved from
    resources.gpus; q4's one shard is the spec's own rule there, CPU pods only)."""
    assert SPEC_RULES[len(SPEC_RULES) - len(OPERATOR_RULES) :] == OPERATOR_RULES
    renamed = SPEC_RULES[: len(SPEC_RULES) - len(OPERATOR_RULES)]
    assert [r.check for r in renamed] == [
        r.check for r in CROSS_FIELD_RULES if set(r.fields) <= SETTING_PATHS.keys()
    ]
    left_out = [r for r in CROSS_FIELD_RULES if not set(r.fields) <= SETTING_PATHS.keys()]
    assert all(
        "enable_chunked_prefill" in r.fields or "tensor_parallel_size" in r.fields for r in left_out
    ), left_out
    assert len(ALL_MESSAGES) == len(SPEC_RULES)  # a message names one rule


SOURCES = st.sampled_from(
    [
        {"pvc": {"claimName": "models"}},
        {"hostPath": "/models/llama"},
        {"image": {"path": "/opt/models/llama"}},
        {"uri": "s3://b/l", "initImage": "fetch:1"},
        {"uri": "s3://b/l"},
        {"hostPath": "/models/llama", "initImage": "fetch:1"},
        {"hostPath": "/models/llama", "pvc": {"claimName": "models"}},
        {},
    ]
)
SMALL = st.integers(0, 8)
RANDOM_SPEC_CHANGES = st.fixed_dictionaries(
    {
        "scheduler.maxNumSeqs": st.integers(1, 8),
        "scheduler.maxNumBatchedTokens": st.integers(1, 8),
        "scheduler.chunkSize": SMALL,
        "scheduler.maxWaiting": SMALL,
        "scheduler.maxWaitingPerTenant": st.none() | st.integers(1, 8),
        "scheduler.preemptionMode": st.sampled_from(["auto", "recompute", "swap"]),
        "engine.swapSpace": st.sampled_from([0, 0.5, 4]),
        "slaTiers": st.none()
        | st.lists(
            st.fixed_dictionaries({"name": st.sampled_from("abc"), "priority": st.integers(0, 2)}),
            max_size=4,
        ),
        "tensorParallelSize": st.none() | st.integers(1, 4),
        "resources.gpus": st.integers(0, 4),
        "model.source": SOURCES,
        "router.replicas": st.integers(0, 1),
        "autoscaling": st.fixed_dictionaries(
            {
                "enabled": st.booleans(),
                "via": st.sampled_from(["hpa", "keda"]),
                "minReplicas": st.integers(0, 3),
                "maxReplicas": st.integers(1, 3),
                "prometheusURL": st.sampled_from([None, "", "http://p:9090"]),
            }
        ),
    }
)


@given(RANDOM_SPEC_CHANGES)
@settings(max_examples=120, deadline=None, derandomize=True, database=None)
def test_cel_rules_and_models_agree_on_random_specs(changes: dict[str, Any]) -> None:
    """Each rule's CEL (on the node it sits on, after defaulting) and its Python predicate
    (the spec models') refuse the same random specs with the same message."""
    resource = patched(EXAMPLE, changes)
    _, failures = admit(resource)
    assert sorted(failures) == sorted(python_errors(resource["spec"]))


# -- resources: Kubernetes quantities, int or string ---------------------------------------

QUANTITIES_OK = [
    ("resources.cpu", 8, "8"),
    ("resources.cpu", "8", "8"),
    ("resources.cpu", "500m", "500m"),
    ("resources.cpu", 0, "0"),
    ("resources.cpu", "1.5", "1.5"),
    ("resources.memory", "64Gi", "64Gi"),
    ("resources.memory", 68719476736, "68719476736"),
    ("resources.memory", "512M", "512M"),
    ("resources.memory", "1e9", "1e9"),
]
QUANTITIES_BAD = [
    ("resources.cpu", "-1"),
    ("resources.cpu", -1),
    ("resources.cpu", "8 cores"),
    ("resources.cpu", ""),
    ("resources.cpu", 0.5),  # a float: written as "500m" (the API server refuses it too)
    ("resources.cpu", True),
    ("resources.memory", "lots"),
    ("resources.memory", "64GB"),
    ("resources.memory", "-64Gi"),
    ("resources.memory", [64]),
    ("resources.memory", "1e1.5"),  # a fractional exponent: the quantity parser refuses it
]


@pytest.mark.parametrize(("path", "value", "parsed"), QUANTITIES_OK)
def test_quantities_int_or_string_accepted(path: str, value: Any, parsed: str) -> None:
    resource = patched(EXAMPLE, {path: value})
    defaulted, failures = admit(resource)  # the schema takes it
    assert failures == []
    field = path.rsplit(".", 1)[1]
    # The models take it too and hand it to the builders as a string.
    assert getattr(parse_spec(resource["spec"]).resources, field) == parsed
    assert getattr(parse_spec(defaulted["spec"]).resources, field) == parsed


@pytest.mark.parametrize(("path", "value"), QUANTITIES_BAD)
def test_quantities_malformed_or_negative_refused(path: str, value: Any) -> None:
    resource = patched(EXAMPLE, {path: value})
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(resource)
    with pytest.raises(SpecError, match=rf"spec\.{re.escape(path)}: "):
        parse_spec(resource["spec"])


def test_quantities_unset_or_null() -> None:
    for changes in ({"resources": {"gpus": 4}}, {"resources.cpu": None, "resources.memory": None}):
        resource = patched(EXAMPLE, changes)
        assert admit(resource)[1] == []
        resources = parse_spec(resource["spec"]).resources
        assert (resources.cpu, resources.memory) == (None, None)


# -- spec.rollout: DESIGN.md's field names -------------------------------------------------

ROLLOUT_DEFAULTS = {
    "strategy": "all",
    "canaryPods": 1,
    "bakeSeconds": 60,
    "maxTtftP99RegressionPct": 20,
    "maxTpotP50RegressionPct": 15,
    "minRequests": 100,
}
ROLLOUT_OK = [
    ("canaryPods", 1000),
    ("bakeSeconds", 1),
    ("bakeSeconds", 86400),
    ("maxTtftP99RegressionPct", 0),
    ("maxTpotP50RegressionPct", 12.5),
]
ROLLOUT_BAD = [
    ("canaryPods", 0),
    ("bakeSeconds", 0),  # no bake: nothing measured before a promotion
    ("bakeSeconds", 86401),
    ("bakeSeconds", -60),
    ("bakeSeconds", "5m"),  # whole seconds only
    ("bakeSeconds", 1.5),
    ("maxTtftP99RegressionPct", -1),
    ("maxTpotP50RegressionPct", 10001),
    ("maxTpotP50RegressionPct", "15%"),
    # v1alpha1's first names: unknown fields like any other (no compatibility shim).
    ("canaryReplicas", 1),
    ("bakeTime", 300),
    ("maxTTFTP99Increase", 0.2),
    ("maxTPOTP50Increase", 0.15),
]


def test_rollout_defaults_are_designs() -> None:
    assert admit(MINIMAL)[0]["spec"]["rollout"] == ROLLOUT_DEFAULTS
    assert parse_spec(MINIMAL["spec"]).rollout.model_dump() == ROLLOUT_DEFAULTS


@pytest.mark.parametrize(("field", "value"), ROLLOUT_OK)
def test_rollout_fields_accepted(field: str, value: Any) -> None:
    resource = patched(EXAMPLE, {f"rollout.{field}": value})
    assert admit(resource)[1] == []
    assert getattr(parse_spec(resource["spec"]).rollout, field) == value


@pytest.mark.parametrize(("field", "value"), ROLLOUT_BAD)
def test_rollout_fields_out_of_range_or_unknown_refused(field: str, value: Any) -> None:
    resource = patched(EXAMPLE, {f"rollout.{field}": value})
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(resource)
    with pytest.raises(SpecError, match=rf"spec\.rollout\.{field}: "):
        parse_spec(resource["spec"])
