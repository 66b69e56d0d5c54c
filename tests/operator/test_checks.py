"""Specs the schema lets through but the API server or ``iterserve serve`` would refuse are
refused with a SpecError naming the field (:mod:`iterserve.operator.checks`); odd specs that
are accepted build objects valid for Kubernetes 1.33 and read back as built (quantities and
empty values in the API server's canonical form, so ``apply`` does not patch every pass)."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import kubernetes_validate
import pytest

from iterserve.operator.builders import Context, build_all, canonical_quantity
from iterserve.operator.checks import MAX_NAME, serve_parser
from iterserve.operator.spec import SpecError, parse_spec

SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "source": {"hostPath": "/models/tiny"}},
    "image": "ghcr.io/example/iterserve:0.2.0",
    "resources": {"gpus": 0},
}


def _spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def _build(spec: dict[str, Any], name: str = "tiny", namespace: str = "demo") -> list[Any]:
    return build_all(Context(name, namespace), parse_spec(spec))


@pytest.mark.parametrize(
    ("name", "namespace"),
    [
        ("a" * (MAX_NAME + 1), "demo"),  # N-router over 63 characters
        ("1chat", "demo"),  # a Service name must start with a letter
        ("chat.v1", "demo"),  # valid for the resource, not for its Services
        ("chat-", "demo"),
        ("Chat", "demo"),
        ("chat", "Demo Space"),
        (123, "demo"),
        ("chat-router", "demo"),  # the router Deployment of "chat"
    ],
)
def test_names_the_owned_objects_cannot_carry_are_refused(name: Any, namespace: str) -> None:
    with pytest.raises(SpecError, match=r"metadata\.(name|namespace)"):
        _build(SPEC, name, namespace)


def test_the_longest_name_builds_valid_objects() -> None:
    objects = _build(SPEC, "a" * MAX_NAME)
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    assert max(len(n) for n in names) == 63
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"pod": {"extraArgs": ["--port", "9000"]}}, "--port is set by the operator"),
        ({"pod": {"extraArgs": ["--po=9000"]}}, "--port is set by the operator"),
        ({"pod": {"extraArgs": ["--host", "::"]}}, "--host is set by the operator"),
        ({"pod": {"extraArgs": ["--config", "/x"]}}, "--config is set by the operator"),
        ({"pod": {"extraArgs": ["--config-version", "9"]}}, "--config-version is set"),
        ({"pod": {"extraArgs": ["--max-model-len", "9"]}}, "--max-model-len is set"),
        ({"pod": {"extraArgs": ["--no-enable-prefix-caching"]}}, "--enable-prefix-caching"),
        ({"pod": {"extraArgs": ["--max-num-seqs", "4"]}}, "live setting"),
        ({"pod": {"extraArgs": ["--tiers", "/etc/passwd"]}}, "live setting"),
        ({"pod": {"extraArgs": ["--admin-token", "x"]}}, "admin-token Secret"),
        ({"pod": {"extraArgs": ["--api-key", "x"]}}, "API-key Secret"),
        ({"pod": {"extraArgs": ["--no-such-flag"]}}, "unrecognized arguments"),
        ({"pod": {"extraArgs": ["--seed", "x"]}}, "invalid int value"),
        ({"model": {**SPEC["model"], "name": "--port"}}, "spec.model.name"),
        ({"pod": {"env": [{"name": "ITERSERVE_ADMIN_TOKEN", "value": "x"}]}}, "operator"),
        ({"pod": {"env": [{"name": "ITERSERVE_API_KEY", "value": "x"}]}}, "operator"),
        ({"pod": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}, "twice"),
        ({"pod": {"env": [{"value": "x"}]}}, r"env\[0\]: name"),
        ({"pod": {"env": [{"name": "A=B", "value": "x"}]}}, r"env\[0\]: name"),
        ({"pod": {"env": [{"name": "A", "value": 1}]}}, "must be a string"),
        ({"pod": {"env": [{"name": "A", "valueFrom": {}, "value": "x"}]}}, "excludes value"),
        ({"pod": {"env": [{"name": "A", "vaule": "x"}]}}, "unknown keys"),
        ({"pod": {"labels": {"tier": "a" * 64}}}, "label value"),
        ({"pod": {"labels": {"bad key": "x"}}}, "qualified name"),
        ({"pod": {"labels": {"Bad_Prefix/x": "x"}}}, "qualified name"),
        ({"pod": {"nodeSelector": {"gpu": "a b"}}}, "label value"),
        ({"pod": {"annotations": {"a b": "x"}}}, "qualified name"),
        ({"pod": {"tolerations": [{"keyy": "x"}]}}, "unknown keys"),
        ({"pod": {"affinity": {"nodeAffinty": {}}}}, "unknown keys"),
        ({"pod": {"imagePullSecrets": [{"secret": "x"}]}}, "imagePullSecrets"),
        ({"model": {"name": "m", "source": {"pvc": {"claimName": "My Claim"}}}}, "claimName"),
        ({"model": {"name": "m", "source": {"hostPath": "/models/../etc"}}}, "'..'"),
        ({"image": " ghcr.io/x:1"}, "whitespace"),
        ({"router": {"image": "router:1\n"}}, "whitespace"),
        ({"tensorParallelSize": 4}, "needs resources.gpus"),
    ],
)
def test_specs_kubernetes_or_the_server_would_refuse(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecError, match=reason):
        _build(_spec(**changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {**SPEC["model"], "name": 'org/my "model" 模型'}},  # only an argument
        {"pod": {"labels": {"app.kubernetes.io/instance": "other", "team": ""}}},
        {"pod": {"extraArgs": ["--seed", "3", "--enable-prefix-caching", "--log-prompts"]}},
        {"pod": {"env": [{"name": "HF_HOME", "value": ""}, {"name": "my.var-1", "value": "x"}]}},
        {"replicas": 0, "router": {"replicas": 0}},
        {"engine": {"maxModelLen": 100}},  # below chunkSize: the server takes it
        {"slaTiers": [{"name": 'gold "1" {x}', "priority": 0}, {"name": "Gold", "priority": 1}]},
        {"resources": {"gpus": 0, "cpu": "1000m", "memory": "1.5Gi"}},
    ],
)
def test_odd_specs_accepted_build_valid_objects(changes: dict[str, Any]) -> None:
    objects = _build(_spec(**changes))
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "tiny"
    ]
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "tiny"
    for entry in template["spec"]["containers"][0]["env"]:
        assert entry.get("value") != "", entry  # the API server would drop it


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("1000m", "1"),
        ("1500m", "1500m"),
        ("0.5", "500m"),
        ("8", "8"),
        ("1000", "1k"),
        ("1200", "1200"),
        ("1024Mi", "1Gi"),
        ("1.5Gi", "1536Mi"),
        ("64Gi", "64Gi"),
        ("0.5Ki", "512"),
        ("1000M", "1G"),
        ("1e9", "1e9"),
        ("1.5e3", "1500"),
        ("0", "0"),
        ("0.0000000001", "1n"),
    ],
)
def test_quantities_as_the_api_server_writes_them_back(written: str, canonical: str) -> None:
    assert canonical_quantity(written) == canonical
    spec = _spec(resources={"gpus": 0, "cpu": written, "memory": written})
    (deployment,) = [
        o for o in _build(spec) if o["kind"] == "Deployment" and o["metadata"]["name"] == "tiny"
    ]
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"] == resources["requests"] == {"cpu": canonical, "memory": canonical}


def test_the_headless_service_sets_no_false_the_api_server_drops() -> None:
    (service,) = [
        o for o in _build(SPEC) if (o["kind"], o["metadata"]["name"]) == ("Service", "tiny-server")
    ]
    assert "publishNotReadyAddresses" not in service["spec"]  # false: omitted on read-back


def test_the_serve_parser_is_the_clis() -> None:
    """:func:`serve_parser` (the control plane does not import the CLI) takes the same
    flags, to the same destinations, with the same choices and types as ``iterserve serve``
    (``--tiers`` aside: a string, so that the operator reads no file)."""
    from iterserve.cli import build_parser

    def serve_actions(parser: argparse.ArgumentParser) -> dict[str, Any]:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        serve = sub.choices["serve"]
        return {
            tuple(a.option_strings): (a.dest, a.choices, a.nargs, type(a).__name__, a.type)
            for a in serve._actions
            if a.option_strings and a.dest not in ("help", "tiers")
        }

    assert serve_actions(serve_parser()) == serve_actions(build_parser())
