"""The operator's side of the Gateway API Inference Extension and of router availability:
``spec.router.mode: endpointPicker`` (the InferencePool ``N`` and the picker ``N-epp`` instead
of the proxy router), the routers' PodDisruptionBudget, and ``spec.router.kvEvents`` (the
servers publish, the router subscribes, the NetworkPolicy lets it). The API server's view of
the InferencePool is the cluster tier's (tests/cluster/test_endpoint_picker.py); here it is
checked against the same CRD with jsonschema."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_fakes import MemoryKube
from kubernetes.aio.client.exceptions import ApiException

from iterserve.cli import build_parser
from iterserve.operator.builders import Context, build_all
from iterserve.operator.checks import check_name
from iterserve.operator.reconcile import OperatorSettings, Outcome, reconcile
from iterserve.operator.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
POOL_CRD = ROOT / "tools" / "k8s" / "crds" / "inferencepools.inference.networking.k8s.io.yaml"
EXAMPLE: dict[str, Any] = yaml.safe_load(
    (Path(__file__).parent / "examples" / "chat-70b.yaml").read_text()
)
N, NS = "chat-70b", "serving"
GATEWAY_NS = "gateway-system"


def build(**router: Any) -> dict[tuple[str, str], Any]:
    """The objects of the example with ``spec.router`` changed (and the gateway's namespace
    in apiFrom, as endpointPicker mode needs), by (kind, name)."""
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["router"].update(router)
    spec.setdefault("networkPolicy", {})["apiFrom"] = [GATEWAY_NS]
    return _by_key(spec)


def _by_key(spec: dict[str, Any]) -> dict[tuple[str, str], Any]:
    objects = build_all(Context(N, NS, control_image="control:test"), parse_spec(spec))
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(by_key) == len(objects)
    return by_key


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_picker_mode_replaces_the_router_with_a_pool_and_a_picker() -> None:
    objects = build(mode="endpointPicker")
    names = set(objects)
    for gone in ("Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"):
        assert (gone, f"{N}-router") not in names
        assert (gone, f"{N}-epp") in names
    # One ServiceAccount and Role for the router or the picker (EndpointSlices).
    assert {("ServiceAccount", f"{N}-router"), ("Role", f"{N}-router")} <= names
    assert list(objects)[-1] == ("InferencePool", N)
    assert objects["PodDisruptionBudget", f"{N}-epp"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": objects["Deployment", f"{N}-epp"]["spec"]["selector"][
            "matchLabels"]},
    }  # fmt: skip


def test_the_pool_selects_the_server_pods_and_names_the_pickers_service() -> None:
    objects = build(mode="endpointPicker", failureMode="FailOpen")
    pool = objects["InferencePool", N]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    server = objects["Deployment", N]["spec"]
    pod_labels = server["template"]["metadata"]["labels"]
    selected = pool["spec"]["selector"]["matchLabels"]
    assert selected == server["selector"]["matchLabels"]
    assert selected.items() <= pod_labels.items()
    (http,) = [p for p in container(objects["Deployment", N])["ports"] if p["name"] == "http"]
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    service = objects["Service", f"{N}-epp"]
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc == {"name": "grpc", "port": 9002, "targetPort": "grpc",
                    "appProtocol": "kubernetes.io/h2c"}  # fmt: skip
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": service["metadata"]["name"],
        "port": {"number": grpc["port"]},
        "failureMode": "FailOpen",
    }
    picker = objects["Deployment", f"{N}-epp"]["spec"]
    assert service["spec"]["selector"] == picker["selector"]["matchLabels"]
    assert build(mode="endpointPicker")["InferencePool", N]["spec"]["endpointPickerRef"][
        "failureMode"] == "FailClose"  # fmt: skip


def test_the_pool_passes_the_inference_pool_crds_schema() -> None:
    (version,) = yaml.safe_load(POOL_CRD.read_text())["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    pool = build(mode="endpointPicker")["InferencePool", N]
    jsonschema.Draft7Validator(schema).validate(pool)
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"].append({"number": 8001})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def test_the_picker_runs_the_router_in_endpoint_picker_mode() -> None:
    objects = build(mode="endpointPicker", policy="session", replicas=3)
    router = container(build(policy="session")["Deployment", f"{N}-router"])
    picker = container(objects["Deployment", f"{N}-epp"])
    deployment = objects["Deployment", f"{N}-epp"]
    assert deployment["spec"]["replicas"] == 3
    assert picker["image"] == "control:test" and picker["command"] == ["iterserve"]
    # What the router gets, the picker gets (discovery, policy, credentials, grace period),
    # in endpoint-picker mode.
    mode = ["--mode", "endpoint-picker", "--grpc-port", "9002"]
    assert picker["args"] == ["router", *mode, *router["args"][1:]]
    parsed = build_parser().parse_args(picker["args"])  # the router's own parser
    assert (parsed.mode, parsed.grpc_port, parsed.port) == ("endpoint-picker", 9002, 8080)
    assert (flag(router["args"], "--port"), flag(router["args"], "--policy")) == ("8080", "session")
    assert picker["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "grpc", "containerPort": 9002, "protocol": "TCP"},
    ]
    assert picker["volumeMounts"] == router["volumeMounts"]
    assert picker.get("env") == router.get("env")
    assert picker["readinessProbe"] == router["readinessProbe"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{N}-router"
    assert deployment["spec"]["template"]["metadata"]["labels"][
        "app.kubernetes.io/component"] == "epp"  # fmt: skip


@pytest.mark.parametrize(("replicas", "budget"), [(0, False), (1, False), (2, True), (5, True)])
def test_the_routers_budget_from_two_replicas(replicas: int, budget: bool) -> None:
    objects = build(replicas=replicas)
    assert (("PodDisruptionBudget", f"{N}-router") in objects) == budget
    if budget:
        pdb = objects["PodDisruptionBudget", f"{N}-router"]
        assert pdb["spec"] == {
            "maxUnavailable": 1,
            "selector": objects["Deployment", f"{N}-router"]["spec"]["selector"],
        }
        assert pdb["metadata"]["labels"]["app.kubernetes.io/component"] == "router"


def test_two_routers_by_default() -> None:
    spec = copy.deepcopy(EXAMPLE["spec"])
    del spec["router"]
    objects = _by_key(spec)
    assert objects["Deployment", f"{N}-router"]["spec"]["replicas"] == 2
    assert ("PodDisruptionBudget", f"{N}-router") in objects


def test_without_kv_events_the_servers_publish_and_the_router_does_not_subscribe() -> None:
    """The servers always publish (DESIGN.md): kvEvents is the router's subscription, so
    turning it on or off rolls the router pods only."""
    objects = build()
    server = container(objects["Deployment", N])
    assert flag(server["args"], "--kv-events-port") == "5557"
    assert [p["name"] for p in server["ports"]] == ["http", "admin", "kv-events"]
    assert "--kv-events-port" not in container(objects["Deployment", f"{N}-router"])["args"]
    policy = objects["NetworkPolicy", f"{N}-server"]["spec"]["ingress"]
    assert [rule["ports"] for rule in policy] == [[{"protocol": "TCP", "port": 8000}],
                                                  [{"protocol": "TCP", "port": 8001}],
                                                  [{"protocol": "TCP", "port": 5557}]]  # fmt: skip
    on = build(kvEvents=True)
    assert on["Deployment", N] == objects["Deployment", N]


@pytest.mark.parametrize("mode", ["proxy", "endpointPicker"])
def test_kv_events_wire_the_servers_the_router_and_the_policy(mode: str) -> None:
    objects = build(mode=mode, kvEvents=True)
    front = "epp" if mode == "endpointPicker" else "router"
    server = container(objects["Deployment", N])
    assert flag(server["args"], "--kv-events-port") == "5557"
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in server["ports"]
    router = container(objects["Deployment", f"{N}-{front}"])
    assert flag(router["args"], "--kv-events-port") == "5557"
    # The example's weights are on a PVC: the router reads the tokenizer from it, read-only.
    model_dir = flag(server["args"], "--model")
    assert flag(router["args"], "--tokenizer") == model_dir
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in router["volumeMounts"]
    volumes = objects["Deployment", f"{N}-{front}"]["spec"]["template"]["spec"]["volumes"]
    server_volumes = objects["Deployment", N]["spec"]["template"]["spec"]["volumes"]
    (model,) = [v for v in volumes if v["name"] == "model"]
    assert model in server_volumes
    *_, kv_rule = objects["NetworkPolicy", f"{N}-server"]["spec"]["ingress"]
    selector = objects["Deployment", f"{N}-{front}"]["spec"]["selector"]
    gateway = {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [GATEWAY_NS]}
            ]
        }
    }
    assert kv_rule == {"from": [{"podSelector": selector}, gateway],
                       "ports": [{"protocol": "TCP", "port": 5557}]}  # fmt: skip


@pytest.mark.parametrize(
    "source",
    [{"image": {"path": "/opt/models/llama"}}, {"uri": "s3://b/llama", "initImage": "fetch:1"}],
    ids=["image", "uri"],
)
def test_kv_events_need_weights_the_router_can_mount(source: dict[str, Any]) -> None:
    """The router's KV-event match needs the model's tokenizer: with the weights in the server
    image or downloaded per pod it has none to read (it would not start), so the spec is
    refused, naming the fields."""
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["model"]["source"] = source
    _by_key(spec)  # without kvEvents: fine
    spec["router"]["kvEvents"] = True
    with pytest.raises(SpecError, match=r"router.kvEvents needs the model's tokenizer"):
        _by_key(spec)


def test_picker_mode_policies_let_the_gateway_in() -> None:
    objects = build(mode="endpointPicker")
    server = objects["NetworkPolicy", f"{N}-server"]["spec"]["ingress"]
    gateway = {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [GATEWAY_NS]}
            ]
        }
    }
    picker = {"podSelector": objects["Deployment", f"{N}-epp"]["spec"]["selector"]}  # fmt: skip
    api_peers = server[0]["from"]
    assert picker in api_peers and gateway in api_peers
    assert all("router" not in str(peer) for peer in api_peers)
    assert objects["NetworkPolicy", f"{N}-epp"]["spec"] == {
        "podSelector": picker["podSelector"],
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [gateway], "ports": [{"protocol": "TCP", "port": 9002},
                                                  {"protocol": "TCP", "port": 8080}]}],
    }  # fmt: skip


def test_picker_mode_needs_the_gateways_namespace_while_policies_are_on() -> None:
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["router"]["mode"] = "endpointPicker"
    with pytest.raises(SpecError, match=r"needs the gateway's namespace in networkPolicy"):
        parse_spec(spec)
    spec["networkPolicy"] = {"enabled": False}
    objects = _by_key(spec)
    assert not any(kind == "NetworkPolicy" for kind, _ in objects)


@pytest.mark.parametrize("mode", ["proxy", "endpointPicker"])
def test_every_object_but_the_pool_is_valid_for_kubernetes(mode: str) -> None:
    for obj in build(mode=mode, kvEvents=True).values():
        if obj["kind"] == "InferencePool":  # a custom resource: its CRD's schema, above
            continue
        kubernetes_validate.validate(obj, "1.33", strict=True)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("mode", "gateway", "spec.router.mode"),
        ("failureMode", "FailSometimes", "spec.router.failureMode"),
        ("kvEvents", "maybe", "spec.router.kvEvents"),
    ],
)
def test_bad_router_fields_are_refused_naming_them(field: str, value: Any, error: str) -> None:
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["router"][field] = value
    with pytest.raises(SpecError, match=error):
        parse_spec(spec)


def test_a_name_ending_in_epp_is_refused() -> None:
    """Resource ``chat-epp``'s server Deployment would be resource ``chat``'s picker."""
    with pytest.raises(SpecError, match=r"must not end in '-epp': the endpoint picker"):
        check_name("chat-epp", NS)


# -- reconciling: switching modes, the InferencePool CRD missing -----------------------------

BODY: dict[str, Any] = {
    "apiVersion": "iterserve.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "tiny", "namespace": "demo", "uid": "uid-tiny", "generation": 1},
    "spec": {
        "model": {"name": "tiny", "source": {"hostPath": "/models/tiny"}},
        "image": "ghcr.io/example/iterserve:0.2.0",
        "resources": {"gpus": 0},
        "networkPolicy": {"apiFrom": [GATEWAY_NS]},
    },
}
ROUTER_OBJECTS = {
    (kind, "tiny-router")
    for kind in ("Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget")
}
PICKER_OBJECTS = {
    (kind, "tiny-epp") for kind in ("Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget")
} | {("InferencePool", "tiny")}


def _body(mode: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(BODY)
    body["spec"]["router"] = {"mode": mode}
    if status is not None:
        body["status"] = status
    return body


def _pass(kube: MemoryKube, body: dict[str, Any]) -> Outcome:
    return asyncio.run(reconcile(kube, body, OperatorSettings()))


def test_switching_modes_deletes_the_other_modes_objects() -> None:
    kube = MemoryKube()
    outcome = _pass(kube, _body("proxy"))
    assert set(kube.objects) >= ROUTER_OBJECTS and not PICKER_OBJECTS & set(kube.objects)
    assert outcome.status["routerURL"] == "http://tiny-router.demo.svc:8080"
    assert outcome.status["inferencePool"] is None

    outcome = _pass(kube, _body("endpointPicker"))
    assert set(kube.objects) >= PICKER_OBJECTS and not ROUTER_OBJECTS & set(kube.objects)
    # The ServiceAccount and Role serve both.
    assert {("ServiceAccount", "tiny-router"), ("Role", "tiny-router")} <= set(kube.objects)
    assert (outcome.status["routerURL"], outcome.status["inferencePool"]) == (None, "tiny")
    deleted = {message for _, reason, message in outcome.events if reason == "Deleted"}
    assert deleted == {f"{kind} {name}" for kind, name in ROUTER_OBJECTS}

    _pass(kube, _body("proxy"))
    assert set(kube.objects) >= ROUTER_OBJECTS and not PICKER_OBJECTS & set(kube.objects)


def test_an_object_of_someone_elses_is_not_deleted_on_a_switch() -> None:
    kube = MemoryKube()
    _pass(kube, _body("endpointPicker"))
    kube.objects["Deployment", "tiny-router"] = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "tiny-router", "namespace": "demo"},
    }  # fmt: skip
    _pass(kube, _body("endpointPicker"))
    assert ("Deployment", "tiny-router") in kube.objects


class NoPoolAPI(MemoryKube):
    """An API server without the InferencePool CRD: 404 for the kind's every request."""

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any | None:
        if kind == "InferencePool":
            return None  # Kube.get: 404 is None
        return await super().get(api_version, kind, namespace, name)

    async def create(self, body: dict[str, Any]) -> Any:
        if body["kind"] == "InferencePool":
            raise ApiException(status=404, reason="the server could not find the resource")
        return await super().create(body)


def test_without_the_pool_crd_the_picker_runs_and_ready_says_why() -> None:
    kube = NoPoolAPI()
    outcome = _pass(kube, _body("endpointPicker"))
    assert {(k, n) for k, n in PICKER_OBJECTS if k != "InferencePool"} <= set(kube.objects)
    (ready,) = [c for c in outcome.status["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InferencePoolMissing")
    assert "install the Gateway API Inference Extension's CRDs" in ready["message"]
    warnings = [e for e in outcome.events if e[1] == "InferencePoolMissing"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning"
    # The next pass (the resync timer) says it again in the status, not in another Event.
    again = _pass(kube, _body("endpointPicker", outcome.status))
    assert [c["reason"] for c in again.status["conditions"] if c["type"] == "Ready"] == [
        "InferencePoolMissing"]  # fmt: skip
    assert ready["lastTransitionTime"] == next(
        c["lastTransitionTime"] for c in again.status["conditions"] if c["type"] == "Ready"
    )
    assert not [e for e in again.events if e[1] == "InferencePoolMissing"]
    # Back to proxy mode: nothing to delete, no error.
    outcome = _pass(kube, _body("proxy", again.status))
    assert [c["reason"] for c in outcome.status["conditions"] if c["type"] == "Ready"] != [
        "InferencePoolMissing"]  # fmt: skip


def test_kv_events_name_the_pod_in_the_topic() -> None:
    """The publisher's topic is ``kv@<pod>@<model>``, its pod from ``POD_NAME``: the pod's
    name from the downward API (a container's hostname need not be it), with or without
    kvEvents (the servers always publish); a POD_NAME of the user's is refused."""
    field = {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
    for objects in (build(), build(kvEvents=True)):
        assert {"name": "POD_NAME", "valueFrom": field} in container(objects["Deployment", N])[
            "env"
        ]
    spec = copy.deepcopy(EXAMPLE["spec"])
    spec["pod"] = {"env": [{"name": "POD_NAME", "value": "mine"}]}
    with pytest.raises(SpecError, match=r"spec.pod.env\[0\]: POD_NAME is set by the operator"):
        _by_key(spec)
