"""charts/iterserve: lint, render with default and non-default values, every object through
``kubernetes-validate --strict`` for the Kubernetes version the chart declares, wrong values
refused by values.schema.json, crds/ identical to the top-level crds/, and the RBAC equal to
what the operator calls in a recorded run against KMock."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import kmock
import kopf
import kubernetes_validate
import pytest
import yaml
from kmock_cluster import TOKEN, cluster

from iterserve.cli import build_parser
from iterserve.operator.builders import Context, build_all, labels, router_rbac
from iterserve.operator.main import PEERING_NAME, render
from iterserve.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "iterserve"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
APP_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# The oldest Kubernetes the chart admits (Chart.yaml kubeVersion ">=X.Y.Z-0"), and the newest
# kubernetes-validate knows: every built-in object must validate against both.
_MINIMUM = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)-0", CHART_META["kubeVersion"])
assert _MINIMUM is not None, CHART_META["kubeVersion"]
MIN_VERSION = _MINIMUM[1]
VERSIONS = (MIN_VERSION, kubernetes_validate.latest_version())
RELEASE, NAMESPACE = "iterserve", "iterserve-system"
FULLNAME = "iterserve"  # the release's name holds the chart's: no suffix

# Kinds with no schema offline (CRDs of the Prometheus Operator, kopf and iterserve): their
# apiVersion is checked here, the fields the chart sets by the tests below (the example by the
# operator's own validation; the PrometheusRule's rules by tests/packaging/test_observability.py).
CUSTOM_KINDS = {
    "LLMDeployment": "iterserve.io/v1alpha1",
    "ClusterKopfPeering": "kopf.dev/v1",
    "KopfPeering": "kopf.dev/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
}

WATCHED = ["serving", "batch"]
NON_DEFAULT: dict[str, Any] = {
    "image": {"repository": "registry.example/ml/iterserve", "tag": "9.9.9-control",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "watchNamespaces": WATCHED,
    "logLevel": "debug",
    "operator": {"resyncIntervalS": 30, "pushTimeoutS": 2.5,
                 "controlImage": "registry.example/ml/router:1", "livenessPort": 9091},
    "resources": {"requests": {"cpu": "250m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
    "nodeSelector": {"pool": "system"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system",
                     "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "priorityClassName": "system-cluster-critical",
    "podAnnotations": {"example.com/team": "ml"},
    "podLabels": {"team": "ml"},
    "serviceAccount": {"annotations": {"example.com/role": "none"}},
    "example": {"enabled": True, "name": "demo", "namespace": "serving", "replicas": 2,
                "cpu": 3, "memory": "6Gi"},
    "dashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"},
                  "annotations": {"grafana_folder": "iterserve"}},
    "alerts": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}, "interval": "30s"},
        "podMonitor": {"enabled": True, "labels": {"release": "kps"}, "interval": "10s"},
    },
}  # fmt: skip


def _run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def _template(helm: Path, *args: str) -> list[dict[str, Any]]:
    proc = _run(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


@pytest.fixture(scope="module")
def values_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("values") / "values.yaml"
    path.write_text(yaml.safe_dump(NON_DEFAULT))
    return path


@pytest.fixture(scope="module")
def default_objects(helm: Path) -> list[dict[str, Any]]:
    return _template(helm)


@pytest.fixture(scope="module")
def custom_objects(helm: Path, values_file: Path) -> list[dict[str, Any]]:
    return _template(helm, "-f", str(values_file))


def _one(objects: list[dict[str, Any]], kind: str, namespace: str | None = None) -> dict[str, Any]:
    (obj,) = [
        o
        for o in objects
        if o["kind"] == kind and namespace in (None, o["metadata"].get("namespace"))
    ]
    return obj


def _validate_all(objects: Iterable[dict[str, Any]]) -> None:
    """Built-in kinds through kubernetes-validate --strict at both versions; custom kinds by
    their apiVersion."""
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            assert obj["apiVersion"] == CUSTOM_KINDS[obj["kind"]], obj
            assert obj["metadata"]["name"]
            continue
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


# --------------------------------------------------------------------------- lint, versions


def test_chart_versions_follow_the_package() -> None:
    assert (CHART_META["apiVersion"], CHART_META["name"]) == ("v2", "iterserve")
    assert CHART_META["appVersion"] == APP_VERSION
    assert CHART_META["version"] == "0.1.0"
    assert MIN_VERSION in {v.removeprefix("v").split("-")[0] for v in _schema_versions()}


def _schema_versions() -> set[str]:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return {p.name for p in root.iterdir()}


def test_lint_strict_with_default_and_custom_values(helm: Path, values_file: Path) -> None:
    for extra in ([], ["-f", str(values_file)]):
        proc = _run(helm, "lint", "--strict", str(CHART), "-n", NAMESPACE, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 chart(s) failed" in proc.stdout
        assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_refuses_a_kubernetes_older_than_declared(helm: Path) -> None:
    major, minor, _ = MIN_VERSION.split(".")
    older = f"{major}.{int(minor) - 1}.0"
    proc = _run(helm, "template", RELEASE, str(CHART), "--kube-version", older)
    assert proc.returncode != 0
    assert "kubeVersion" in proc.stderr
    proc = _run(helm, "template", RELEASE, str(CHART), "--kube-version", MIN_VERSION)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- default values


def test_default_render_is_valid(default_objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == sorted(
        ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "ClusterKopfPeering",
         "Role", "RoleBinding", "NetworkPolicy"]
    )  # fmt: skip
    _validate_all(default_objects)
    peering = _one(default_objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == PEERING_NAME
    assert "namespace" not in peering["metadata"]


def test_default_operator_deployment(default_objects: list[dict[str, Any]]) -> None:
    deployment = _one(default_objects, "Deployment")
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    image = f"ghcr.io/iterserve/iterserve:{APP_VERSION}-control"
    assert container["image"] == image
    assert container["command"] == ["iterserve"]
    assert container["args"] == [
        "operator", "run", f"--control-image={image}", "--resync-interval-s=10",
        "--push-timeout-s=5", "--liveness-port=8081", "--liveness-host=$(POD_IP)",
        "--metrics-port=8082",
        f"--operator-namespace={NAMESPACE}",
        "--operator-label=app.kubernetes.io/component=operator",
        f"--operator-label=app.kubernetes.io/instance={RELEASE}",
        "--operator-label=app.kubernetes.io/name=iterserve",
        "--log-level=info",
    ]  # fmt: skip
    # /healthz on the pod's own address (the kubelet probes the pod IP).
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
        container["env"]
    )
    # The flags parse, and the chart's defaults are the CLI's.
    args = build_parser().parse_args(container["args"])
    defaults = build_parser().parse_args(["operator", "run"])
    for flag in (
        "resync_interval_s",
        "push_timeout_s",
        "liveness_port",
        "metrics_port",
        "log_level",
        "control_image",
    ):
        assert getattr(args, flag) == getattr(defaults, flag), flag
    assert (args.namespace, args.control_image, args.standalone) == ([], image, False)
    # Liveness on kopf's /healthz, on the port the operator listens on; its /metrics beside.
    port, metrics = container["ports"]
    assert (port["name"], port["containerPort"]) == ("healthz", args.liveness_port)
    assert (metrics["name"], metrics["containerPort"]) == ("metrics", args.metrics_port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # Hardened: non-root, read-only root, no capabilities, the runtime's seccomp profile.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    # The images' own user (every final stage of the Dockerfile).
    users = set(re.findall(r"^USER (\d+):(\d+)$", (REPO / "Dockerfile").read_text(), re.M))
    context = pod["securityContext"]
    assert users == {(str(context["runAsUser"]), str(context["runAsGroup"]))}
    assert pod["serviceAccountName"] == _one(default_objects, "ServiceAccount")["metadata"]["name"]
    binding = _one(default_objects, "ClusterRoleBinding")
    role_name = _one(default_objects, "ClusterRole")["metadata"]["name"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name
    }  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]


# --------------------------------------------------------------------------- non-default values


def test_custom_render_is_valid(custom_objects: list[dict[str, Any]]) -> None:
    _validate_all(custom_objects)
    kinds = [o["kind"] for o in custom_objects]
    for kind in ("Role", "RoleBinding", "KopfPeering"):
        assert sorted(o["metadata"]["namespace"] for o in custom_objects if o["kind"] == kind) == (
            sorted(WATCHED)
        ), kind  # the Secrets in the watched namespaces' Roles, no Role of their own
    assert "ClusterKopfPeering" not in kinds
    for kind in ("LLMDeployment", "ServiceMonitor", "PodMonitor", "ServiceAccount"):
        assert kinds.count(kind) == 1, kind
    # The observability helper's templates, whatever they render, when they exist.
    if (CHART / "templates" / "prometheusrule.yaml").exists():
        assert "PrometheusRule" in kinds
    if (CHART / "templates" / "dashboard.yaml").exists():
        assert "ConfigMap" in kinds


def test_custom_operator_deployment(custom_objects: list[dict[str, Any]]) -> None:
    pod = _one(custom_objects, "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/ml/iterserve:9.9.9-control"
    assert container["imagePullPolicy"] == "Always"
    args = build_parser().parse_args(container["args"])
    assert args.namespace == WATCHED
    assert (args.control_image, args.log_level) == ("registry.example/ml/router:1", "debug")
    assert (args.resync_interval_s, args.push_timeout_s, args.liveness_port) == (30, 2.5, 9091)
    assert container["ports"][0]["containerPort"] == 9091
    assert container["resources"] == NON_DEFAULT["resources"]
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"):
        assert pod["spec"][key] == NON_DEFAULT[key], key
    assert pod["metadata"]["annotations"] == NON_DEFAULT["podAnnotations"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    account = _one(custom_objects, "ServiceAccount")
    assert account["metadata"]["annotations"] == NON_DEFAULT["serviceAccount"]["annotations"]


def test_namespaced_rbac_is_the_cluster_wide_rules_per_namespace(
    default_objects: list[dict[str, Any]], custom_objects: list[dict[str, Any]]
) -> None:
    """Checked table (KMock 0.8 cannot list namespaces, so kopf's namespaced mode is not run):
    each Role holds the ClusterRole's namespaced rules with the namespaced KopfPeering instead
    of the ClusterKopfPeering; only what kopf reads cluster-wide stays in a ClusterRole (CRDs,
    and namespaces, which kopf's namespace observer lists and watches when not cluster-wide)."""
    secrets = {("", "secrets", v) for v in ("get", "create", "patch")}
    cluster_wide = _grants(_one(default_objects, "ClusterRole")["rules"]) | secrets
    cluster_scoped = {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    peering = {("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")}
    per_namespace = (cluster_wide - cluster_scoped - peering) | {
        ("kopf.dev", "kopfpeerings", v) for v in ("list", "watch", "patch")
    }
    account = _one(custom_objects, "ServiceAccount")["metadata"]["name"]
    subject = [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    for namespace in WATCHED:
        role = _one(custom_objects, "Role", namespace)
        assert _grants(role["rules"]) == per_namespace, namespace
        binding = _one(custom_objects, "RoleBinding", namespace)
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == subject
        assert _one(custom_objects, "KopfPeering", namespace)["metadata"]["name"] == PEERING_NAME
    assert _grants(_one(custom_objects, "ClusterRole")["rules"]) == cluster_scoped | {
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    assert _one(custom_objects, "ClusterRoleBinding")["subjects"] == subject


def test_secrets_only_where_llmdeployments_live(helm: Path) -> None:
    """Cluster-wide, the ClusterRole holds no Secrets: a Role in the release's namespace and
    in each secretNamespaces entry does (the release's kept when others are listed: a new
    user's walk-through lost it), or the ClusterRole with secretsInAllNamespaces."""

    def secret_grants(objects: list[dict[str, Any]]) -> dict[tuple[str, str | None], bool]:
        return {
            (o["kind"], o["metadata"].get("namespace")): any(
                "secrets" in r["resources"] for r in o["rules"]
            )
            for o in objects
            if o["kind"] in ("Role", "ClusterRole")
        }

    assert secret_grants(_template(helm)) == {
        ("ClusterRole", None): False,
        ("Role", NAMESPACE): True,
    }
    listed = _template(helm, "--set", f"secretNamespaces={{serving,batch,{NAMESPACE}}}")
    assert secret_grants(listed) == {
        ("ClusterRole", None): False, ("Role", NAMESPACE): True, ("Role", "serving"): True,
        ("Role", "batch"): True,
    }  # fmt: skip
    bindings = [o for o in listed if o["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(
        [NAMESPACE, "serving", "batch"]
    )  # one each, the release's namespace listed again included
    assert all(b["subjects"][0]["namespace"] == NAMESPACE for b in bindings)
    everywhere = _template(helm, "--set", "secretsInAllNamespaces=true")
    assert secret_grants(everywhere) == {("ClusterRole", None): True}


def test_operator_network_policy(helm: Path, default_objects: list[dict[str, Any]]) -> None:
    """Ingress only to its /metrics port; egress to the server pods
    the operator builds (their API and admin ports) and to the API server by port; off with
    networkPolicy.enabled false."""
    policy = _one(default_objects, "NetworkPolicy")["spec"]
    pod_labels = _one(default_objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8082}]}]
    pods, api_server = policy["egress"]
    (peer,) = pods["to"]
    server = labels("chat", "server")
    assert peer["podSelector"]["matchLabels"].items() <= server.items()
    assert peer["namespaceSelector"] == {}  # cluster-wide: any namespace
    assert [p["port"] for p in pods["ports"]] == [8000, 8001]
    assert "to" not in api_server and [p["port"] for p in api_server["ports"]] == [443, 6443]
    watched = _one(_template(helm, "--set", "watchNamespaces={serving}"), "NetworkPolicy")
    (peer,) = watched["spec"]["egress"][0]["to"]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["serving"]
    off = _template(helm, "--set", "networkPolicy.enabled=false")
    assert not any(o["kind"] == "NetworkPolicy" for o in off)


def test_example_passes_the_operators_validation(custom_objects: list[dict[str, Any]]) -> None:
    """The example LLMDeployment through the operator's own parse_spec and build_all (the
    models the CRD's schema is generated from, unknown fields refused), and what the
    operator would build from it through kubernetes-validate."""
    example = _one(custom_objects, "LLMDeployment")
    assert (example["metadata"]["name"], example["metadata"]["namespace"]) == ("demo", "serving")
    spec = example["spec"]
    assert spec["image"] == f"registry.example/ml/iterserve:{APP_VERSION}-cpu"
    assert spec["model"]["source"] == {
        "image": {"path": "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"}
    }
    parsed = parse_spec(spec)
    assert (parsed.resources.gpus, parsed.replicas) == (0, 2)
    assert (str(parsed.resources.cpu), str(parsed.resources.memory)) == ("3", "6Gi")
    built = render(example, "registry.example/ml/router:1")
    _validate_all(built)
    server = next(o for o in built if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo")
    (container,) = server["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_example_by_default_in_the_release_namespace(helm: Path) -> None:
    example = _one(_template(helm, "--set", "example.enabled=true"), "LLMDeployment")
    assert example["metadata"]["namespace"] == NAMESPACE
    assert example["spec"]["image"] == f"ghcr.io/iterserve/iterserve:{APP_VERSION}-cpu"
    render(example, "control:test")  # valid for the operator


def test_example_is_the_plain_cpu_demo(helm: Path) -> None:
    """examples/cpu-demo.yaml, which a user applies without Helm, is the chart's example with
    the chart's defaults (all but the release's namespace and Helm's labels)."""
    example = _one(_template(helm, "--set", "example.enabled=true"), "LLMDeployment")
    plain = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())
    assert plain["metadata"] == {"name": example["metadata"]["name"]}
    assert plain["spec"] == example["spec"]


def test_monitors_select_what_the_operator_builds(custom_objects: list[dict[str, Any]]) -> None:
    example = _one(custom_objects, "LLMDeployment")
    built = render(example, "control:test")
    router_svc = next(o for o in built if o["kind"] == "Service" and "clusterIP" not in o["spec"])
    server_svc = next(o for o in built if o["kind"] == "Service" and "clusterIP" in o["spec"])
    server_pods = next(
        o for o in built if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo"
    )
    pod_labels = server_pods["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, Any], target: dict[str, str]) -> bool:
        assert all(e["operator"] == "In" for e in selector.get("matchExpressions", []))
        return all(target.get(k) == v for k, v in selector["matchLabels"].items()) and all(
            target.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
        )

    for kind, endpoints_key, interval in (
        ("ServiceMonitor", "endpoints", "30s"),
        ("PodMonitor", "podMetricsEndpoints", "10s"),
    ):
        monitor = _one(custom_objects, kind)
        assert monitor["metadata"]["labels"]["release"] == "kps"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": WATCHED}
        (endpoint,) = monitor["spec"][endpoints_key]
        assert endpoint == {"port": "http", "path": "/metrics", "interval": interval}
        assert set(monitor["spec"]) == {"namespaceSelector", "selector", endpoints_key}
    service_selector = _one(custom_objects, "ServiceMonitor")["spec"]["selector"]
    assert selects(service_selector, router_svc["metadata"]["labels"])
    assert not selects(service_selector, server_svc["metadata"]["labels"])
    assert [p["name"] for p in router_svc["spec"]["ports"]] == ["http"]
    # In endpointPicker mode, the picker's Service (its /metrics: the wake trigger's series).
    picker_spec = {**example["spec"], "router": {"mode": "endpointPicker"},
                   "networkPolicy": {"enabled": False}}  # fmt: skip
    picked = render({**example, "spec": picker_spec}, "control:test")
    (picker_svc,) = [
        o for o in picked if o["kind"] == "Service" and "-epp" in o["metadata"]["name"]
    ]
    assert selects(service_selector, picker_svc["metadata"]["labels"])
    assert "http" in [p["name"] for p in picker_svc["spec"]["ports"]]
    pod_selector = _one(custom_objects, "PodMonitor")["spec"]["selector"]
    assert selects(pod_selector, pod_labels)
    assert not selects(pod_selector, labels("demo", "router"))
    (server,) = server_pods["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in server["ports"]] == ["http", "admin", "kv-events"]  # scraped: http


def test_the_operators_own_monitor_scrapes_its_metrics_port(helm: Path) -> None:
    objects = _template(helm, "--set", "metrics.operatorPodMonitor.enabled=true")
    monitor = _one(objects, "PodMonitor")
    deployment = _one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "honorLabels": True,
                        "interval": "30s"}  # fmt: skip
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "metrics" in [p["name"] for p in container["ports"]]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    _validate_all(objects)


def test_monitors_cluster_wide_select_every_namespace(helm: Path) -> None:
    on = (
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.podMonitor.enabled=true",
    )
    objects = _template(helm, *on)
    for kind in ("ServiceMonitor", "PodMonitor"):
        assert _one(objects, kind)["spec"]["namespaceSelector"] == {"any": True}


def test_notes_say_what_to_run_next(helm: Path) -> None:
    """NOTES.txt (rendered by an install's dry run): the example's names, and a live patch
    that the operator accepts and that changes the premium tier's queue-wait limit."""
    proc = _run(
        helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client",
        "--set", "example.enabled=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    for command in (
        f"kubectl -n {NAMESPACE} rollout status deployment/{FULLNAME}",
        f"kubectl -n {NAMESPACE} get llmd smollm2-demo -w",
        f"kubectl -n {NAMESPACE} port-forward svc/smollm2-demo-router 8080:8080",
        f"kubectl -n {NAMESPACE} get secret smollm2-demo-api-key",
        "docs/kubernetes.md",
    ):
        assert command in notes, command
    (patch,) = re.findall(r"patch llmd smollm2-demo --type merge -p '(.+)'", notes)
    example = _one(_template(helm, "--set", "example.enabled=true"), "LLMDeployment")
    patched = parse_spec({**example["spec"], **json.loads(patch)["spec"]})
    (premium,) = [t for t in patched.slaTiers if t.name == "premium"]
    assert premium.maxQueueWaitMs == 500
    before = parse_spec(example["spec"])
    (premium_before,) = [t for t in before.slaTiers if t.name == "premium"]
    assert premium_before.maxQueueWaitMs != 500
    # Nothing else changes: the other tiers and the premium tier's other fields stay as they were.
    assert patched.slaTiers == [
        t.model_copy(update={"maxQueueWaitMs": 500}) if t.name == "premium" else t
        for t in before.slaTiers
    ]


# --------------------------------------------------------------------------- wrong values

DIGEST = "sha256:" + "0123456789abcdef" * 4
# Wrong values the API server, a CRD or Prometheus would refuse half-way through an install:
# (--set-json PATH, JSON value, what helm's schema error must say). Each must fail at the
# schema, naming the field.
SCHEMA_REFUSES: list[tuple[str, str, str]] = [
    ("logLevel", '"verbose"', "'/logLevel'"),
    ("watchNamespaces", '["Not_A_Namespace"]', "'/watchNamespaces/0'"),
    ("image.pullPolicy", '"Sometimes"', "'/image/pullPolicy'"),
    ("image.repository", '"ghcr.io/Iterserve/iterserve"', "'/image/repository'"),  # uppercase
    ("image.repository", '"ghcr.io/iterserve/iterserve@sha256:abc"', "'/image/repository'"),
    ("image.repository", '"ghcr.io/iter serve"', "'/image/repository'"),
    ("image.tag", '"v1:2"', "'/image/tag'"),
    ("image.digest", '"sha256:abc"', "'/image/digest'"),
    ("imagePullSecrets", '[{"name": "Registry_Secret"}]', "'/imagePullSecrets/0/name'"),
    ("operator.controlImage", '"Router Image"', "'/operator/controlImage'"),
    ("operator.resyncIntervalS", "0", "'/operator/resyncIntervalS': minimum"),
    ("operator.resyncIntervalS", "3601", "'/operator/resyncIntervalS': maximum"),
    ("operator.pushTimeoutS", "0", "'/operator/pushTimeoutS': minimum"),
    ("operator.pushTimeoutS", "301", "'/operator/pushTimeoutS': maximum"),
    ("fullnameOverride", '"-abc-"', "'/fullnameOverride'"),
    ("nameOverride", '"Foo_Bar"', "'/nameOverride'"),
    ("resources.requests.cpu", "-1", "'/resources/requests/cpu': minimum"),
    ("resources.requests.memory", '"1.2.3"', "'/resources/requests/memory'"),
    ("resources.limits.memory", '"1iii"', "'/resources/limits/memory'"),
    ("resources.limits.cpu", '"-1"', "'/resources/limits/cpu'"),  # the sign, as a string
    ("resources.limits.ephemeral-storage", '"1Gi2"', "'/resources/limits/ephemeral-storage'"),
    ("resources.requests.gpu", "1", "'gpu' not allowed"),
    ("example.cpu", "-2", "'/example/cpu': minimum"),
    ("example.cpu", '"lots"', "'/example/cpu'"),
    ("example.memory", '"1mmm"', "'/example/memory'"),
    ("example.replicas", "1001", "'/example/replicas': maximum"),
    ("example.name", '"9-starts-with-a-digit"', "'/example/name'"),
    ("example.image", '"Example:latest"', "'/example/image'"),
    ("priorityClassName", '"System_Critical"', "'/priorityClassName'"),
    ("nodeSelector", '{"pool": "-system"}', "'/nodeSelector/pool'"),
    ("podAnnotations", '{"a/b/c": "x"}', "'/podAnnotations': additional properties 'a/b/c'"),
    # podLabels: valid keys and values only, none of the chart's own (the selector's above all).
    ("podLabels", '{"app.kubernetes.io/name": "x"}', "'/podLabels/app.kubernetes.io~1name'"),
    (
        "podLabels",
        '{"app.kubernetes.io/instance": "x"}',
        "'/podLabels/app.kubernetes.io~1instance'",
    ),
    (
        "podLabels",
        '{"app.kubernetes.io/component": "x"}',
        "'/podLabels/app.kubernetes.io~1component'",
    ),
    ("podLabels", '{"Bad_Prefix/team": "ml"}', "'/podLabels': additional properties"),
    ("podLabels", '{"team": "-ml"}', "'/podLabels/team'"),
    ("podLabels", '{"team": "' + "x" * 64 + '"}', "'/podLabels/team': maxLength"),
    ("dashboard.labels", '{"grafana dashboard": "1"}', "'/dashboard/labels': additional"),
    ("dashboard.enable", "true", "'enable' not allowed"),
    ("alerts.labels", '{"helm.sh/chart": "x"}', "'/alerts/labels/helm.sh~1chart'"),
    (
        "metrics.serviceMonitor.labels",
        '{"release": "kps/1"}',
        "'/metrics/serviceMonitor/labels/release'",
    ),
    (
        "metrics.podMonitor.labels",
        '{"app.kubernetes.io/managed-by": "me"}',
        "'/metrics/podMonitor/labels/app.kubernetes.io~1managed-by'",
    ),
    # The API server's toleration rules.
    (
        "tolerations",
        '[{"key": "k", "operator": "Exists", "value": "v"}]',
        "'/tolerations/0/value': value must be ''",
    ),
    ("tolerations", '[{"value": "v"}]', "'/tolerations/0': missing property 'operator'"),
    (
        "tolerations",
        '[{"key": "k", "value": "v", "tolerationSeconds": 5}]',
        "'/tolerations/0': missing property 'effect'",
    ),
    ("tolerations", '[{"key": "bad key", "operator": "Exists"}]', "'/tolerations/0/key'"),
    # Prometheus durations: units in descending order, each once; a bounded length.
    ("alerts.kvLeakFor", '"1m1h"', "'/alerts/kvLeakFor'"),
    ("alerts.configSkewFor", '"10 m"', "'/alerts/configSkewFor'"),
    ("alerts.queueWaitFor", '"12345678901234567h"', "'/alerts/queueWaitFor': maxLength"),
    ("alerts.kvUsageRatio", "1", "'/alerts/kvUsageRatio': exclusiveMaximum"),
    ("alerts.kvUsageRatio", "0", "'/alerts/kvUsageRatio': exclusiveMinimum"),
    ("alerts.kvUsageRatio", '"0.9"', "'/alerts/kvUsageRatio'"),  # what --set makes of 0.9
    ("metrics.podMonitor.interval", '"soon"', "'/metrics/podMonitor/interval'"),
    ("metrics.podMonitor.interval", '"0s"', "'/metrics/podMonitor/interval'"),
    ("metrics.serviceMonitor.interval", '"30s1m"', "'/metrics/serviceMonitor/interval'"),
]


def _batches(cases: list[tuple[str, str, str]]) -> list[list[tuple[str, str, str]]]:
    """The cases in as few helm calls as possible: helm reports every schema error at once,
    so a batch holds cases whose paths do not overlap (one value per field)."""
    batches: list[list[tuple[str, str, str]]] = []
    for case in cases:
        path = case[0] + "."
        for batch in batches:
            if not any(path.startswith(p + ".") or (p + ".").startswith(path) for p, *_ in batch):
                batch.append(case)
                break
        else:
            batches.append([case])
    return batches


@pytest.mark.parametrize(
    "batch", _batches(SCHEMA_REFUSES), ids=lambda b: f"{len(b)}-values-from-{b[0][0]}"
)
def test_wrong_values_fail_at_the_schema_naming_the_field(
    helm: Path, batch: list[tuple[str, str, str]]
) -> None:
    flags = [f for path, value, _ in batch for f in ("--set-json", f"{path}={value}")]
    proc = _run(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *flags)
    assert proc.returncode != 0
    assert "don't meet the specifications of the schema" in proc.stderr, proc.stderr
    missing = [(path, value, m) for path, value, m in batch if m not in proc.stderr]
    assert not missing, f"{missing} not refused:\n{proc.stderr}"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        # The template's checks (after the schema).
        (["watchNamespaces={a}", "example.enabled=true"], "example.namespace"),
        (["metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.interval=61s"],
         "metrics.serviceMonitor.interval 61s is longer than 60s"),
        (["metrics.podMonitor.enabled=true", "metrics.podMonitor.interval=1m500ms"],
         "metrics.podMonitor.interval 1m500ms is longer than 60s"),
        # Breaker finding: one port for both rendered, and the operator crash-looped (the
        # second listener cannot bind).
        (["operator.metricsPort=8081"],
         "operator.metricsPort 8081 must differ from operator.livenessPort"),
    ],
)  # fmt: skip
def test_wrong_values_fail_in_the_template(helm: Path, settings: list[str], message: str) -> None:
    proc = _run(
        helm, "template", RELEASE, str(CHART), "-n", NAMESPACE,
        *[f for s in settings for f in ("--set", s)],
    )  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_values_at_the_edge_of_the_grammars_render(helm: Path, tmp_path: Path) -> None:
    """The schema is no stricter than Kubernetes and Prometheus: quantities with every suffix
    kind, a registry with a port, a digest, label keys with prefixes, the tolerations the API
    server accepts, durations with several units; and a digest renders as repository@digest."""
    values = {
        "image": {"repository": "registry.example:5000/ml/iter_serve", "digest": DIGEST,
                  "tag": "ignored-with-a-digest"},
        "operator": {"resyncIntervalS": 1, "pushTimeoutS": 0.1,
                     "controlImage": f"registry.example/ml/router:v1.2_rc-3@{DIGEST}"},
        "resources": {"requests": {"cpu": ".5", "memory": "1e9", "ephemeral-storage": "1Ki"},
                      "limits": {"cpu": 2, "memory": "512Mi"}},
        "fullnameOverride": "ops-1",
        "priorityClassName": "system.cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux", "node.example/pool": ""},
        "tolerations": [
            {"operator": "Exists"},
            {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "example.com/gpu", "value": "a100", "effect": "NoExecute",
             "tolerationSeconds": 60},
        ],
        "podLabels": {"example.com/team": "ml-1", "tier": "A.b_c"},
        "podAnnotations": {"example.com/note": "any text: / @ %"},
        "example": {"enabled": True, "replicas": 1000, "cpu": "500m", "memory": "3.5Gi",
                    "image": "localhost:5000/iterserve:cpu"},
        "alerts": {"enabled": True, "kvUsageRatio": 0.999, "kvLeakFor": "1h30m",
                   "configSkewFor": "0", "queueWaitFor": "1d2h3m4s5ms"},
        "metrics": {"serviceMonitor": {"enabled": True, "interval": "1m"},
                    "podMonitor": {"enabled": True, "interval": "59s500ms"}},
    }  # fmt: skip
    path = tmp_path / "edge.yaml"
    path.write_text(json.dumps(values))  # JSON is YAML whose strings stay strings ("1e9")
    objects = _template(helm, "-f", str(path))
    (container,) = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"registry.example:5000/ml/iter_serve@{DIGEST}"
    assert container["resources"] == values["resources"]
    _validate_all(o for o in objects if o["kind"] != "LLMDeployment")
    render(_one(objects, "LLMDeployment"), "control:test")  # the operator takes the example
    # Without a digest the control image defaults to repository:tag, the routers' too.
    (container,) = _one(_template(helm), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/iterserve/iterserve:{APP_VERSION}-control"


# --------------------------------------------------------------------------- two releases


def test_releases_in_two_namespaces_own_disjoint_objects(helm: Path) -> None:
    """One operator per team (docs/kubernetes.md): every object the two releases render, the
    cluster-scoped ClusterRole and ClusterRoleBinding included, is a different one, so Helm's
    ownership check lets both install. Cluster-wide, only the ClusterKopfPeering is shared (by
    design: two cluster-wide operators must see each other and pause)."""

    def keys(objects: list[dict[str, Any]]) -> set[tuple[str, str | None, str]]:
        return {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
                for o in objects}  # fmt: skip

    everything = [
        "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
        "--set", "dashboard.enabled=true", "--set", "alerts.enabled=true",
    ]  # fmt: skip
    renders = {}
    for team in ("team-a", "team-b"):
        proc = _run(
            helm, "template", "iterserve", str(CHART), "-n", team,
            "--set", f"watchNamespaces={{{team}}}", "--set", "example.enabled=true", *everything,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        renders[team] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    a, b = keys(renders["team-a"]), keys(renders["team-b"])
    assert a & b == set()
    cluster_scoped = {(k, n) for k, ns, n in a if ns is None}
    assert cluster_scoped == {
        ("ClusterRole", "iterserve-team-a"), ("ClusterRoleBinding", "iterserve-team-a")
    }  # fmt: skip
    # Each binding names its own ClusterRole and its own release's ServiceAccount.
    binding = _one(renders["team-b"], "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "iterserve-team-b"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "iterserve", "namespace": "team-b"}
    ]
    # Cluster-wide: the RBAC still differs; the peering is the operator's fixed one.
    wide = {ns: keys(_template_in(helm, ns)) for ns in ("ops-a", "ops-b")}
    assert wide["ops-a"] & wide["ops-b"] == {("ClusterKopfPeering", None, PEERING_NAME)}


def _template_in(helm: Path, namespace: str) -> list[dict[str, Any]]:
    proc = _run(helm, "template", RELEASE, str(CHART), "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


# --------------------------------------------------------------------------- CRDs


def test_chart_crds_are_the_top_level_crds() -> None:
    top, chart = REPO / "crds", CHART / "crds"
    names = sorted(p.name for p in top.iterdir())
    assert names == sorted(p.name for p in chart.iterdir())
    assert {"llmdeployments.iterserve.io.yaml", "kopfpeerings.kopf.dev.yaml",
            "clusterkopfpeerings.kopf.dev.yaml"} <= set(names)  # fmt: skip
    for name in names:
        assert (top / name).read_bytes() == (chart / name).read_bytes(), name


def test_crds_are_valid_and_the_peering_ones_are_kopfs() -> None:
    crds = {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.yaml"))}
    _validate_all(crds.values())
    # kopf's own selectors (what it looks for): group, version, plural; scope as it expects.
    from kopf._cogs.structs import references

    for selector, scope in (
        (references.CLUSTER_PEERINGS_K, "Cluster"),
        (references.NAMESPACED_PEERINGS_K, "Namespaced"),
    ):
        name = f"{selector.any_name}.{selector.group}"
        crd = crds[f"{name}.yaml"]
        assert crd["metadata"]["name"] == name
        (version,) = crd["spec"]["versions"]
        names = crd["spec"]["names"]
        resource = references.Resource(
            group=crd["spec"]["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            singular=names["singular"],
            namespaced=crd["spec"]["scope"] == "Namespaced",
        )
        assert selector.check(resource), name
        assert (crd["spec"]["scope"], version["served"], version["storage"]) == (scope, True, True)
        # kopf writes free-form peer entries into the status (no status subresource: it
        # patches the object itself).
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True
        assert "subresources" not in version


# --------------------------------------------------------------------------- RBAC, recorded

NS, NAME = "serving", "chat"
API = f"/apis/iterserve.io/v1alpha1/namespaces/{NS}/llmdeployments"
SPEC: dict[str, Any] = {
    "model": {"name": "smol", "source": {"hostPath": "/models/smol"}},
    "image": "iterserve:test",
    "resources": {"gpus": 0},
    "autoscaling": {"enabled": True, "via": "hpa", "maxReplicas": 3},
}
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update"}


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every rule, expanded."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _rbac_request(request: kmock.Request) -> tuple[str, str, str] | None:
    """The (apiGroup, resource[/subresource], verb) RBAC checks for a request; None for
    discovery (/api, /apis/GROUP/VERSION: every authenticated user may read it)."""
    resource = request.resource
    if resource is None or resource.plural is None:
        assert re.fullmatch(r"/api(/v1)?|/apis(/[^/]+/[^/]+)?", request.url.path), request.url
        return None
    plural = resource.plural + (f"/{request.subresource}" if request.subresource else "")
    method = str(request.method.value).upper()
    if method == "GET":
        verb = "watch" if request.params.get("watch") in ("true", "1") else (
            "get" if request.name else "list"
        )  # fmt: skip
    elif method == "DELETE":
        verb = "delete" if request.name else "deletecollection"
    else:
        verb = _VERBS[method]
    return (resource.group or "", plural, verb)


def _path(obj: dict[str, Any]) -> str:
    api = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
    kind = obj["kind"].lower()
    plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"  # networkpolicies
    return f"{api}/namespaces/{NS}/{plural}/{obj['metadata']['name']}"


async def _operator_run(tmp_path: Path) -> set[tuple[str, str, str]]:
    """Run the operator (kopf's peering on, as the chart runs it) through create, a drift of
    every owned object, a live scheduler change, autoscaling by HPA then KEDA then off, an
    invalid spec, the endpoint picker's mode and back, and deletion; every (apiGroup,
    resource, verb) it asked for."""

    async def get(path: str) -> Any:
        response = await k8s.get(path)
        return await response.json() if response.status == 200 else None

    async def until(check: Any, what: str) -> None:
        # Seconds when the machine is idle; generous for a loaded one (deletion waits for
        # kopf to stop the resync timer's pass in flight).
        deadline = time.monotonic() + 60
        while not await check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def managed_by_operator(paths: list[str]) -> bool:
        for path in paths:
            obj = await get(path)
            if obj is None or obj["metadata"]["labels"].get(managed) != "iterserve-operator":
                return False
        return True

    async def drift(paths: list[str]) -> None:
        """Edited by hand: the operator must patch each back."""
        for path in paths:
            await k8s.patch(path, json={"metadata": {"labels": {managed: "someone"}}})
        await until(lambda: managed_by_operator(paths), "drift corrected")

    async def spec(generation: int, new: dict[str, Any]) -> None:
        await k8s.patch(f"{API}/{NAME}", json={"metadata": {"generation": generation}, "spec": new})

    managed = "app.kubernetes.io/managed-by"
    async with cluster(tmp_path, peering=True, versioned=True, resync_interval_s=0.3) as k8s:
        # A Secret of the user's without the key: the operator adds it (a patch).
        await k8s.post(f"/api/v1/namespaces/{NS}/secrets", json={
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {},
            "metadata": {"name": f"{NAME}-api-key", "namespace": NS}})  # fmt: skip
        await k8s.post(API, json={
            "apiVersion": "iterserve.io/v1alpha1", "kind": "LLMDeployment", "spec": SPEC,
            "metadata": {"name": NAME, "namespace": NS, "uid": "uid-chat", "generation": 1,
                         "resourceVersion": "1"}})  # fmt: skip
        owned = [_path(o) for o in build_all(Context(NAME, NS), parse_spec(SPEC))]
        assert any("horizontalpodautoscalers" in p for p in owned)
        await until(lambda: managed_by_operator(owned), "owned objects created")
        await drift(owned)

        # A live scheduler change: the ConfigMap rewritten.
        changed = {**SPEC, "scheduler": {"maxNumSeqs": 16}}
        await spec(2, changed)

        async def config_changed() -> bool:
            config_map = await get(owned[0])
            return "max_num_seqs: 16" in config_map["data"]["scheduler.yaml"]

        await until(config_changed, "the ConfigMap updated")

        # KEDA instead of the HPA, then no autoscaler.
        keda = {**changed, "autoscaling": {**SPEC["autoscaling"], "via": "keda",
                                           "prometheusURL": "http://prometheus:9090"}}  # fmt: skip
        await spec(3, keda)
        scaled_object = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/{NAME}"
        hpa = next(p for p in owned if "horizontalpodautoscalers" in p)

        async def switched() -> bool:
            return await get(scaled_object) is not None and await get(hpa) is None

        await until(switched, "the HPA replaced by a ScaledObject")
        await drift([scaled_object])

        # An invalid spec: an InvalidSpec event, nothing applied.
        await spec(4, {**keda, "scheduler": {"maxNumSeqs": 16, "maxNumBatchedTokens": 8}})

        async def invalid_event() -> bool:
            return any(
                r.method == "POST" and (r.data or {}).get("reason") == "InvalidSpec"
                for r in k8s.served
                if r.url.path.endswith("/events")
            )

        await until(invalid_event, "the InvalidSpec event")
        # Valid again, without an autoscaler (a merge patch: the keys given replace theirs).
        await spec(
            5,
            {
                "scheduler": {"maxNumBatchedTokens": 2048},
                "autoscaling": {"enabled": False},
                "networkPolicy": {"enabled": False},
            },
        )

        async def scaled_object_gone() -> bool:
            return await get(scaled_object) is None

        await until(scaled_object_gone, "the ScaledObject deleted")

        # The endpoint picker instead of the router (the router's Deployment, Service and
        # budget deleted, the InferencePool created), then back (the pool deleted).
        pool = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{NAME}"
        router = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-router"
        await spec(6, {"router": {"mode": "endpointPicker"}})

        async def picker() -> bool:
            return await get(pool) is not None and await get(router) is None

        await until(picker, "the router replaced by the endpoint picker")
        await drift([pool])
        await spec(7, {"router": {"mode": "proxy"}})

        async def proxy() -> bool:
            return await get(pool) is None and await get(router) is not None

        await until(proxy, "the endpoint picker replaced by the router")
        await k8s.delete(f"{API}/{NAME}")

        async def deleted() -> bool:
            return await get(f"{API}/{NAME}") is None

        await until(deleted, "the resource deleted (kopf's finalizer removed)")
    mine = [
        r
        for r in k8s.served
        if {k.lower(): v for k, v in r.headers.items()}.get("authorization") == f"Bearer {TOKEN}"
    ]
    assert len(mine) > 50, len(mine)
    return {g for r in mine if (g := _rbac_request(r)) is not None}


def test_rbac_is_what_the_operator_uses(helm: Path, tmp_path: Path) -> None:
    """Every (apiGroup, resource, verb) the operator asked KMock for is granted by the
    ClusterRole and the Secrets' Role of the LLMDeployment's namespace (``secretNamespaces``),
    and every grant was used, except those the operator holds only to create the
    routers' Role (Kubernetes' escalation rule: it may grant only what it holds) and the
    update of the resource's finalizers, which no request uses: OwnerReferencesPermissionEnforcement
    checks it when an owned object carries blockOwnerDeletion (the cluster tier, tests/cluster,
    runs the operator under it)."""
    kopf.configure(verbose=False)
    used = asyncio.run(asyncio.wait_for(_operator_run(tmp_path), timeout=180))
    objects = _template(helm, "--set", f"secretNamespaces={{{NS}}}")
    secrets = _grants(_one(objects, "Role", NS)["rules"])  # every request is in namespace NS
    assert secrets == {("", "secrets", v) for v in ("get", "create", "patch")}
    granted = _grants(_one(objects, "ClusterRole")["rules"]) | secrets
    assert used - granted == set(), "used but not granted"
    (router_role,) = [o for o in router_rbac(Context(NAME, NS)) if o["kind"] == "Role"]
    held_for_the_routers = _grants(router_role["rules"])
    assert held_for_the_routers == {
        ("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")
    }
    held_for_owner_references = {("iterserve.io", "llmdeployments/finalizers", "update")}
    assert granted - used == held_for_the_routers | held_for_owner_references, (
        "granted but not used"
    )
