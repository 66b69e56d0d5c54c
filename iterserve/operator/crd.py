"""The ``LLMDeployment`` CustomResourceDefinition, generated from the spec models.

One source of truth: ``spec``'s OpenAPI schema is :class:`~iterserve.operator.spec.
LLMDeploymentSpec`'s JSON schema made *structural* (what the API server requires of a CRD):
``$ref`` inlined, ``X | None`` as ``nullable``, ``int | str`` (the models' Kubernetes
quantities) as ``x-kubernetes-int-or-string``, no ``title``, exclusive bounds as OpenAPI v3
booleans, free-form objects marked ``x-kubernetes-preserve-unknown-fields``, and on
sub-objects the models build with ``default_factory`` a default that spells out their fields'
defaults (as pydantic builds them; the API server validates a default against the node's CEL
rules without defaulting inside it, so ``default: {}`` is refused). Descriptions (``kubectl
explain``'s text) are the fields' and the model classes' docstrings, a field's own first, with
their line breaks folded (:func:`description_text`). The rules across fields are :data:`RULES`,
generated from the table the spec models check (:data:`~iterserve.operator.rules.SPEC_RULES`),
with the same messages.

``python -m iterserve.operator.crd > crds/llmdeployments.iterserve.io.yaml`` regenerates the
committed manifest (a test checks that it is current).
"""

from __future__ import annotations

from typing import Any

import yaml

from iterserve.config import Rule, fill
from iterserve.operator.rules import SPEC_RULES, rule_node
from iterserve.operator.spec import GROUP, KIND, PLURAL, VERSION, LLMDeploymentSpec

CRD_NAME = f"{PLURAL}.{GROUP}"
SINGULAR = "llmdeployment"
CRD_FILE = f"crds/{CRD_NAME}.yaml"

HEADER = (
    f"# Generated from iterserve/operator/spec.py by iterserve/operator/crd.py: do not edit.\n"
    f"# Regenerate: python -m iterserve.operator.crd > {CRD_FILE}\n"
)


def cel_rules(rules: tuple[Rule, ...] = SPEC_RULES) -> dict[tuple[str, ...], list[dict[str, str]]]:
    """The CEL rules of ``rules``, keyed by the path (inside spec) of the node each sits on.

    A rule sits on the deepest object holding all of its fields (:func:`rule_node`), its
    fields written as selections from ``self``; one on the spec itself names its first
    field as ``fieldPath`` (what kubectl blames). CEL runs after defaulting, so defaulted
    fields need no has(); a null nullable field reads as absent. Lists are bounded by
    maxItems, which keeps the quadratic uniqueness checks within the API server's cost budget.
    """
    by_node: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for rule in rules:
        node = rule_node(rule)
        selections = {
            name: ".".join(("self", *name.split(".")[len(node) :])) for name in rule.fields
        }
        entry = {"rule": fill(rule.cel, selections), "message": rule.explain()}
        if not node:
            entry["fieldPath"] = selections[rule.fields[0]].removeprefix("self")
        by_node.setdefault(node, []).append(entry)
    return by_node


RULES = cel_rules()

# Keywords copied as they are, in this order (the order the YAML shows).
_COPIED = ("minLength", "maxLength", "minItems", "maxItems", "pattern")
# Keywords handled by _structural; anything else in the models' schema is an error, so a
# construct the conversion does not know fails here instead of reaching the API server.
_INT_OR_STRING = "x-kubernetes-int-or-string"
_KNOWN = {
    *_COPIED,
    *("$ref", "anyOf", "title", "description", "type", "format", "default", "enum"),
    *("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    *("properties", "required", "items"),
    *("additionalProperties", _INT_OR_STRING),
}
# The one union besides `X | None` that has a structural form: an integer or a string.
_INT_OR_STRING_TYPES = [{"type": "integer"}, {"type": "string"}]


def description_text(text: str) -> str:
    """A model's description as the CRD carries it: reST's double backquotes as Markdown's
    single ones, the line breaks inside a paragraph (a docstring's) folded to spaces."""
    paragraphs = text.replace("``", "`").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _merged(inner: dict[str, Any], outer: dict[str, Any]) -> dict[str, Any]:
    """``inner`` (a ``$ref``'s target, a union's option) under ``outer``'s keywords: the
    field's own keywords (its default) win, and its description comes before the target's
    (a model class's docstring) instead of replacing it."""
    node = {**inner, **outer}
    if "description" in inner and "description" in outer:
        node["description"] = f"{outer['description']}\n\n{inner['description']}"
    return node


def _inline(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``node`` with a ``$ref`` replaced by its target, ``X | None`` by ``X`` + nullable and
    ``int | str`` by an int-or-string node that keeps both options' keywords (the integer's
    bounds, the string's pattern: each applies to its own type, in JSON Schema as in the API
    server). See :func:`_merged` for how the field's keywords and the target's combine."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").removeprefix("#/$defs/")]
        node = _merged(_inline(target, defs), node)
    if "anyOf" in node:
        given = node.pop("anyOf")
        options = [o for o in given if o != {"type": "null"}]
        nullable = {"nullable": True} if len(options) < len(given) else {}
        if sorted(o.get("type", "") for o in options) == ["integer", "string"]:
            inner: dict[str, Any] = {_INT_OR_STRING: True}
            for option in options:
                for key, value in option.items():
                    if key != "type" and inner.setdefault(key, value) != value:
                        raise ValueError(f"int | str options disagree on {key}: {options}")
            node = {**_merged(inner, node), **nullable}
        elif len(options) == 1:
            node = {**_merged(_inline(options[0], defs), node), **nullable}
        else:
            raise ValueError(
                f"only `X | None` and `int | str` unions have a structural schema: {options}"
            )
    return node


def _structural(raw: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one JSON-schema node of the models."""
    node = _inline(raw, defs)
    unknown = set(node) - _KNOWN - {"nullable"}
    if unknown:
        raise ValueError(f"no structural form for {sorted(unknown)} (keys {sorted(node)})")
    out: dict[str, Any] = {}
    if "description" in node:
        out["description"] = description_text(node["description"])
    if node.get(_INT_OR_STRING):  # no type (structural schemas' one exception)
        out[_INT_OR_STRING] = True
        out["anyOf"] = [dict(t) for t in _INT_OR_STRING_TYPES]
    else:
        out["type"] = node["type"]
    if "format" in node:
        out["format"] = node["format"]
    if node.get("nullable"):
        out["nullable"] = True
    if node.get("default") is not None:  # a null default is the same as none
        out["default"] = node["default"]
    if "enum" in node:
        out["enum"] = node["enum"]
    for side in ("minimum", "maximum"):  # JSON Schema's exclusive bound: OpenAPI v3's flag
        exclusive = f"exclusive{side.title()}"
        if exclusive in node:
            out[side], out[exclusive] = node[exclusive], True
        elif side in node:
            out[side] = node[side]
    for key in _COPIED:
        if key in node:
            out[key] = node[key]
    if node.get("type") == "array":
        out["items"] = _structural(node["items"], defs)
    if node.get("type") == "object":
        out.update(_object_body(node, defs))
    return out


def _object_body(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    extra = node.get("additionalProperties")
    if "properties" not in node:
        if isinstance(extra, dict):  # dict[str, X]
            return {"additionalProperties": _structural(extra, defs)}
        return {"x-kubernetes-preserve-unknown-fields": True}  # dict[str, Any]
    required = node.get("required", [])
    properties = {}
    for name, raw in node["properties"].items():
        prop = _structural(raw, defs)
        # Optional with no default in the JSON schema: a default_factory. A sub-model whose
        # fields all have defaults defaults to all of them, written out: the API server checks
        # a default against the node's CEL rules as it stands, so `{}` (which its own
        # defaulting would fill in) fails every rule that reads a field ("no such key").
        if (
            name not in required
            and "default" not in raw
            and prop.get("type") == "object"
            and "properties" in prop
            and not prop.get("required")
        ):
            prop["default"] = {
                key: sub["default"] for key, sub in prop["properties"].items() if "default" in sub
            }
        properties[name] = prop
    # No additionalProperties: false (structural schemas forbid it; pruning drops unknowns).
    return {"properties": properties, **({"required": required} if required else {})}


def spec_schema() -> dict[str, Any]:
    """``spec``'s structural OpenAPI v3 schema, :data:`RULES` included."""
    raw = LLMDeploymentSpec.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    schema = _structural(raw, defs)
    for path, rules in RULES.items():
        node = schema
        for name in path:
            node = node["properties"][name]
        node["x-kubernetes-validations"] = rules
    return schema


def _condition_schema() -> dict[str, Any]:
    text = {"type": "string"}
    return {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"description": "Ready, Progressing or SchedulerConfigApplied", **text},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"description": "CamelCase reason of the last transition", **text},
            "message": text,
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
    }


def status_schema() -> dict[str, Any]:
    """``status``: what the operator reports. Unknown fields are kept because kopf writes
    its own bookkeeping there (handler progress under ``status.kopf``, handler results)."""
    integer = {"type": "integer", "format": "int64"}
    return {
        "description": "Written by the operator",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "conditions": {
                "type": "array",
                "maxItems": 16,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": _condition_schema(),
            },
            "readyReplicas": {"description": "server pods ready", **integer},
            "replicas": {"description": "server pods (the scale subresource's)", **integer},
            "observedGeneration": {"description": "the generation last reconciled", **integer},
            "schedulerConfigVersion": {
                "description": "the generation of the last change to spec.scheduler or "
                "spec.slaTiers",
                **integer,
            },
            "schedulerConfigHash": {
                "description": "sha256 of the desired live settings (as a pod's /load "
                "config_hash): how the operator sees that they changed",
                "type": "string",
            },
            "podConfigVersions": {
                "description": "pod name -> the scheduler config version it acknowledged",
                "type": "object",
                "additionalProperties": integer,
            },
            "routerURL": {
                "description": "the router Service's URL, where clients go (spec.router.mode "
                "proxy; absent in endpointPicker mode, where they go to your gateway)",
                "type": "string",
            },
            "inferencePool": {
                "description": "the InferencePool an HTTPRoute's backendRef names "
                "(spec.router.mode endpointPicker only)",
                "type": "string",
            },
            "rollout": {
                "description": "the last canary rollout of the live settings (spec.rollout "
                "strategy canary): phase (Baking, Promoted, RolledBack, Unchecked, Superseded), "
                "target and stable settings, canary pods, start, the gate's last figures, "
                "rejectedHash of a rolled-back change",
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "selector": {
                "description": "label selector of the server pods (the scale subresource's)",
                "type": "string",
            },
            "kopf": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }


_PRINTER_COLUMNS = [
    ("Model", "string", ".spec.model.name"),
    ("Ready", "integer", ".status.readyReplicas"),
    ("Replicas", "integer", ".status.replicas"),
    ("Config", "integer", ".status.schedulerConfigVersion"),
    ("Applied", "string", '.status.conditions[?(@.type=="SchedulerConfigApplied")].status'),
    ("Age", "date", ".metadata.creationTimestamp"),
]


def build_crd() -> dict[str, Any]:
    """The ``llmdeployments.iterserve.io`` CustomResourceDefinition (apiextensions/v1)."""
    schema = {
        "description": "A served model: server pods, router, autoscaler and live scheduler "
        "settings (docs/kubernetes.md in the iterserve repository)",
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        "additionalPrinterColumns": [
            {"name": name, "type": kind, "jsonPath": path} for name, kind, path in _PRINTER_COLUMNS
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": ["llmd"],
                "categories": ["iterserve"],
            },
            "versions": [version],
        },
    }


def render_yaml() -> str:
    """The committed manifest: :data:`HEADER` and :func:`build_crd` as YAML."""
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


if __name__ == "__main__":
    print(render_yaml(), end="")
