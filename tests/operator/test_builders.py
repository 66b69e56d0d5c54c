"""The objects the operator builds for an ``LLMDeployment``, without a cluster.

Exact expectations for the reference example (``examples/chat-70b.yaml``: 4 GPUs, tensor
parallel 4, weights on a PVC) and a minimal CPU spec (no GPUs, weights on a hostPath); every
object checked against the Kubernetes 1.33 OpenAPI schema (``kubernetes-validate``, strict);
the server container's arguments and the ConfigMap's settings file read back through the same
parser and ``--config`` loader ``iterserve serve`` uses; ``iterserve operator render``; the
desired settings against the server's own merge and hash; ``apply`` against an in-memory API
server; the pods the settings are pushed to; conditions' transition times.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml

from iterserve.cli import build_parser, engine_kwargs
from iterserve.cli import main as cli_main
from iterserve.config import (
    ENGINE_CONFIG_CLASSES,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
    SimulationConfig,
)
from iterserve.draining import ABORT_WAIT_S
from iterserve.operator.builders import Context, build_all, quantity
from iterserve.operator.cli_args import DEFAULT_CONTROL_IMAGE
from iterserve.operator.kube import Kube, apply, is_subset
from iterserve.operator.push import PodTarget, ready_targets
from iterserve.operator.reconcile import condition, invalid_status
from iterserve.operator.spec import (
    LLMDeploymentSpec,
    SpecError,
    desired_settings,
    parse_spec,
    settings_hash_of,
)
from iterserve.server.live_config import VersionedSettings, merge, settings_hash, settings_view

EXAMPLE_FILE = Path(__file__).parent / "examples" / "chat-70b.yaml"
EXAMPLE: dict[str, Any] = yaml.safe_load(EXAMPLE_FILE.read_text())
MINIMAL: dict[str, Any] = {
    "apiVersion": "iterserve.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "tiny", "namespace": "demo"},
    "spec": {
        "model": {"name": "tiny", "source": {"hostPath": "/models/tiny"}},
        "image": "ghcr.io/example/iterserve:0.2.0",
        "resources": {"gpus": 0},
    },
}
CONTROL_IMAGE = DEFAULT_CONTROL_IMAGE
KINDS_IN_ORDER = [
    "ConfigMap",
    "Service",
    "Service",
    "Deployment",
    "Deployment",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "PodDisruptionBudget",  # the router's: 2 replicas by default
]
HPA = {"enabled": True, "via": "hpa", "minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 8}
KEDA = {
    "enabled": True,
    "via": "keda",
    "minReplicas": 0,
    "maxReplicas": 3,
    "targetQueueDepth": 2.5,
    "prometheusURL": "http://prometheus.monitoring.svc:9090",
}


def with_spec(document: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of ``document`` whose spec has ``changes`` (top-level spec keys) replaced."""
    changed = copy.deepcopy(document)
    changed["spec"].update(copy.deepcopy(changes))
    return changed


def build(document: dict[str, Any], generation: int = 1) -> dict[tuple[str, str], Any]:
    """The objects of ``document`` by (kind, name)."""
    meta = document["metadata"]
    ctx = Context(meta["name"], meta["namespace"], generation, CONTROL_IMAGE)
    objects = build_all(ctx, parse_spec(document["spec"]))
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(by_key) == len(objects), "two objects of one kind share a name"
    return by_key


def server_pod(document: dict[str, Any]) -> dict[str, Any]:
    name = document["metadata"]["name"]
    pod: dict[str, Any] = build(document)["Deployment", name]["spec"]["template"]
    return pod


def server_container(document: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = server_pod(document)["spec"]["containers"][0]
    return container


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "iterserve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "iterserve-operator",
    }


def selector(name: str, component: str) -> dict[str, str]:
    return {k: v for k, v in labels(name, component).items() if k != "app.kubernetes.io/managed-by"}


# -- names, labels, order ------------------------------------------------------------------


def test_names_labels_and_namespace_derive_from_the_resource() -> None:
    objects = build(EXAMPLE)
    assert list(objects) == [
        ("ConfigMap", "chat-70b-scheduler"),
        ("Service", "chat-70b-server"),
        ("Service", "chat-70b-router"),
        ("Deployment", "chat-70b"),
        ("Deployment", "chat-70b-router"),
        ("ServiceAccount", "chat-70b-router"),
        ("Role", "chat-70b-router"),
        ("RoleBinding", "chat-70b-router"),
        ("NetworkPolicy", "chat-70b-server"),
        ("NetworkPolicy", "chat-70b-router"),
        ("PodDisruptionBudget", "chat-70b"),
        ("PodDisruptionBudget", "chat-70b-router"),
    ]
    router = {"chat-70b-router"}
    for (_, name), obj in objects.items():
        meta = obj["metadata"]
        component = "router" if name in router else "server"
        assert meta == {
            "name": name,
            "namespace": "serving",
            "labels": labels("chat-70b", component),
        }
    # render output: no Secrets (referenced only) and no ownerReferences (need the live uid)
    assert not any(kind == "Secret" for kind, _ in objects)


def test_minimal_cpu_spec_builds_the_same_set_named_after_it() -> None:
    objects = build(MINIMAL)
    assert [kind for kind, _ in objects] == KINDS_IN_ORDER
    assert {name for _, name in objects} == {"tiny-scheduler", "tiny-server", "tiny", "tiny-router"}
    assert all(o["metadata"]["namespace"] == "demo" for o in objects.values())


# -- the server Deployment -----------------------------------------------------------------


def test_server_container_args_of_the_example() -> None:
    assert server_container(EXAMPLE)["command"] == ["iterserve"]
    assert server_container(EXAMPLE)["args"] == [
        "serve",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--model", "/models/llama-3-70b-instruct",
        "--served-model-name", "llama-3-70b-instruct",
        "--config", "/etc/iterserve/scheduler.yaml",
        "--tensor-parallel-size", "4",
        "--dtype", "auto",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.9",
        "--swap-space", "4",
        "--enable-prefix-caching",
        "--quantization", "none",
        "--kv-cache-dtype", "auto",
        "--shutdown-grace-period-s", "30",
        "--admin-port", "8001",
        "--admin-token-file", "/var/run/secrets/iterserve.io/admin/token",
        "--kv-events-port", "5557",
        "--router-token-file", "/var/run/iterserve/router-token/token",
    ]  # fmt: skip


def test_every_engine_flag_and_extra_args_in_order() -> None:
    document = with_spec(
        EXAMPLE,
        engine={
            "dtype": "bfloat16",
            "maxModelLen": 8192,
            "blockSize": 32,
            "gpuMemoryUtilization": 0.85,
            "swapSpace": 0.5,
            "enablePrefixCaching": False,
        },
        tensorParallelSize=2,
        pod={"extraArgs": ["--seed", "7", "--log-prompts"]},
    )
    args = server_container(document)["args"]
    assert args[args.index("--tensor-parallel-size") :] == [
        "--tensor-parallel-size", "2",
        "--dtype", "bfloat16",
        "--block-size", "32",
        "--gpu-memory-utilization", "0.85",
        "--swap-space", "0.5",
        "--no-enable-prefix-caching",
        "--quantization", "none",
        "--kv-cache-dtype", "auto",
        "--shutdown-grace-period-s", "30",
        "--admin-port", "8001",
        "--admin-token-file", "/var/run/secrets/iterserve.io/admin/token",
        "--kv-events-port", "5557",
        "--max-model-len", "8192",
        "--router-token-file", "/var/run/iterserve/router-token/token",
        "--seed", "7", "--log-prompts",
    ]  # fmt: skip


@pytest.mark.parametrize("document", [EXAMPLE, MINIMAL], ids=["example", "minimal"])
def test_server_args_parse_as_iterserve_serve_flags(document: dict[str, Any]) -> None:
    """The real ``iterserve`` parser takes every argument, and they mean the spec's values."""
    spec = parse_spec(document["spec"])
    args = build_parser().parse_args(server_container(document)["args"])
    assert args.command == "serve"
    assert (args.port, args.served_model_name) == (8000, spec.model.name)
    assert args.tensor_parallel_size == spec.tensor_parallel_size
    assert args.dtype == spec.engine.dtype
    assert args.quantization == spec.engine.quantization
    assert args.kv_cache_dtype == spec.engine.kvCacheDtype
    assert args.block_size == spec.engine.blockSize
    assert args.gpu_memory_utilization == spec.engine.gpuMemoryUtilization
    assert args.swap_space == spec.engine.swapSpace
    assert args.enable_prefix_caching is spec.engine.enablePrefixCaching
    assert args.shutdown_grace_period_s == 30


def test_server_pod_of_the_example() -> None:
    pod = server_pod(EXAMPLE)
    container = pod["spec"]["containers"][0]
    assert pod["metadata"] == {
        "labels": labels("chat-70b", "server"),
        "annotations": {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "8000",
            "prometheus.io/path": "/metrics",
        },
    }
    assert container["image"] == "ghcr.io/example/iterserve:0.2.0-cuda"
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "admin", "containerPort": 8001, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
    ]
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": "4", "cpu": "8", "memory": "64Gi"},
        "requests": {"nvidia.com/gpu": "4", "cpu": "8", "memory": "64Gi"},
    }
    assert container["env"] == [
        {
            "name": "ITERSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "chat-70b-api-key", "key": "api-key"}},
        },
        {"name": "XDG_CACHE_HOME", "value": "/var/cache/iterserve"},
        {
            "name": "POD_NAME",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
        },
    ]
    assert pod["spec"]["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "models"}},
        {
            "name": "router-token",
            "secret": {
                "secretName": "chat-70b-router-token",
                "items": [{"key": "token", "path": "token"}],
            },
        },
        {"name": "config", "configMap": {"name": "chat-70b-scheduler"}},
        {"name": "admin-token", "secret": {"secretName": "chat-70b-admin"}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    assert container["volumeMounts"] == [
        {"name": "model", "mountPath": "/models", "readOnly": True},
        {"name": "router-token", "mountPath": "/var/run/iterserve/router-token", "readOnly": True},
        {"name": "config", "mountPath": "/etc/iterserve", "readOnly": True},
        {
            "name": "admin-token",
            "mountPath": "/var/run/secrets/iterserve.io/admin",
            "readOnly": True,
        },
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/var/cache/iterserve"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    assert "initContainers" not in pod["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        assert key not in pod["spec"]  # empty overrides are left out


def test_server_probes_lifecycle_and_grace() -> None:
    container = server_container(EXAMPLE)
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    startup = container["startupProbe"]
    assert liveness["httpGet"] == {"path": "/health", "port": "http"}
    assert readiness["httpGet"] == {"path": "/ready", "port": "http"}
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    # Weights of a 70B model load for minutes: the startup probe holds liveness off >= 10 min.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    # The kubelet's SIGKILL comes after preStop + the server's drain (30 s) + its abort wait.
    grace = server_pod(EXAMPLE)["spec"]["terminationGracePeriodSeconds"]
    assert grace > 5 + 30 + ABORT_WAIT_S


@pytest.mark.parametrize("document", [EXAMPLE, MINIMAL], ids=["example", "minimal"])
def test_pods_run_as_non_root(document: dict[str, Any]) -> None:
    name = document["metadata"]["name"]
    objects = build(document)
    for deployment in (objects["Deployment", name], objects["Deployment", f"{name}-router"]):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }


def test_minimal_cpu_server_has_no_gpu_no_shm_and_surges() -> None:
    deployment = build(MINIMAL)["Deployment", "tiny"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "resources" not in container  # no GPUs, no cpu/memory given: nothing to request
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models"
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
    assert [v["name"] for v in pod["volumes"]] == [
        "model",
        "router-token",
        "config",
        "admin-token",
        "tmp",
        "cache",
    ]
    assert pod["volumes"][0] == {
        "name": "model",
        "hostPath": {"path": "/models/tiny", "type": "Directory"},
    }
    assert "/dev/shm" not in [m["mountPath"] for m in container["volumeMounts"]]
    # CPU pods are not scarce: surge one instead of taking one away.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["selector"] == {"matchLabels": selector("tiny", "server")}


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({"gpus": 0, "cpu": "2", "memory": "4Gi"}, {"cpu": "2", "memory": "4Gi"}),
        ({"gpus": 4, "cpu": 16, "memory": "200Gi"},
         {"nvidia.com/gpu": "4", "cpu": "16", "memory": "200Gi"}),
        ({"gpus": 2, "memory": "64Gi"}, {"nvidia.com/gpu": "2", "memory": "64Gi"}),
        # Only GPUs: the GPUs requested too, never an empty requests map (the API server
        # drops it, and the Deployment would read back drifted on every pass).
        ({"gpus": 1}, {"nvidia.com/gpu": "1"}),
        ({"gpus": 0, "cpu": "500m"}, {"cpu": "500m"}),
    ],
)  # fmt: skip
def test_requests_equal_limits_with_and_without_gpus(
    resources: dict[str, Any], expected: dict[str, str]
) -> None:
    container = server_container(with_spec(MINIMAL, resources=resources))
    assert container["resources"] == {"limits": expected, "requests": expected}


def test_no_resources_without_gpus_cpu_or_memory() -> None:
    """A CPU pod the spec gives no amounts: the namespace's defaults apply."""
    assert "resources" not in server_container(with_spec(MINIMAL, resources={"gpus": 0}))


def test_gpu_strategy() -> None:
    gpu = build(EXAMPLE)["Deployment", "chat-70b"]
    assert gpu["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


@pytest.mark.parametrize(
    ("gpus", "tp", "shm"), [(0, None, False), (1, None, False), (2, 1, False), (2, None, True)]
)
def test_shm_only_with_tensor_parallel(gpus: int, tp: int | None, shm: bool) -> None:
    document = with_spec(MINIMAL, resources={"gpus": gpus}, tensorParallelSize=tp)
    mounts = [m["mountPath"] for m in server_container(document)["volumeMounts"]]
    assert ("/dev/shm" in mounts) is shm
    limits = server_container(document).get("resources", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)  # a quantity


@pytest.mark.parametrize(
    ("source", "model_dir", "volume", "mounted"),
    [
        (
            {"pvc": {"claimName": "weights", "path": ""}},
            "/models",
            {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}},
            True,
        ),
        (
            {"pvc": {"claimName": "weights", "path": "llama/8b"}},
            "/models/llama/8b",
            {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}},
            True,
        ),
        (
            {"hostPath": "/data/llama"},
            "/models",
            {"name": "model", "hostPath": {"path": "/data/llama", "type": "Directory"}},
            True,
        ),
        ({"image": {"path": "/opt/models/llama"}}, "/opt/models/llama", None, False),
        (
            {"uri": "s3://bucket/llama", "initImage": "ghcr.io/example/fetch:1"},
            "/models",
            {"name": "model", "emptyDir": {}},
            True,
        ),
    ],
    ids=["pvc-root", "pvc-path", "hostPath", "image", "uri"],
)
def test_model_sources(
    source: dict[str, Any], model_dir: str, volume: dict[str, Any] | None, mounted: bool
) -> None:
    document = with_spec(MINIMAL, model={"name": "llama", "source": source})
    pod = server_pod(document)["spec"]
    container = pod["containers"][0]
    assert container["args"][container["args"].index("--model") + 1] == model_dir
    models = [v for v in pod["volumes"] if v["name"] == "model"]
    assert models == ([volume] if volume else [])
    model_mounts = [m for m in container["volumeMounts"] if m["name"] == "model"]
    expected_mounts = [{"name": "model", "mountPath": "/models", "readOnly": True}]
    assert model_mounts == (expected_mounts if mounted else [])
    if "uri" in source:
        assert pod["initContainers"] == [
            {
                "name": "download-model",
                "image": "ghcr.io/example/fetch:1",
                "args": ["s3://bucket/llama", "/models"],
                "volumeMounts": [{"name": "model", "mountPath": "/models"}],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ]
    else:
        assert "initContainers" not in pod


def test_pod_overrides_pass_through() -> None:
    overrides = {
        "nodeSelector": {"gpu.example.com/model": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": selector("chat-70b", "server")},
                        },
                    }
                ]
            }
        },
        "imagePullSecrets": [{"name": "registry"}],
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "extraArgs": ["--seed", "3"],
        "annotations": {"example.com/team": "chat"},
        "labels": {"example.com/cost-center": "42"},
    }
    document = with_spec(EXAMPLE, pod=overrides)
    pod = server_pod(document)
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        assert pod["spec"][key] == overrides[key]
    container = pod["spec"]["containers"][0]
    assert container["env"][-1] == {"name": "NCCL_DEBUG", "value": "INFO"}
    assert [e["name"] for e in container["env"]][:2] == ["ITERSERVE_API_KEY", "XDG_CACHE_HOME"]
    assert container["args"][-2:] == ["--seed", "3"]
    assert pod["metadata"]["annotations"]["example.com/team"] == "chat"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["labels"] == {
        "example.com/cost-center": "42",
        **labels("chat-70b", "server"),
    }


def test_pod_labels_cannot_take_over_the_selector() -> None:
    document = with_spec(EXAMPLE, pod={"labels": {"app.kubernetes.io/instance": "other"}})
    deployment = build(document)["Deployment", "chat-70b"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert template_labels["app.kubernetes.io/instance"] == "chat-70b"
    assert is_subset(deployment["spec"]["selector"]["matchLabels"], template_labels)


def test_replicas_written_only_without_autoscaling() -> None:
    assert build(with_spec(EXAMPLE, replicas=3))["Deployment", "chat-70b"]["spec"]["replicas"] == 3
    for autoscaling in (HPA, KEDA):
        scaled = with_spec(EXAMPLE, replicas=3, autoscaling=autoscaling)
        assert "replicas" not in build(scaled)["Deployment", "chat-70b"]["spec"]


def test_a_scheduler_change_changes_the_config_map_but_not_the_pods() -> None:
    before = build(EXAMPLE, generation=1)
    changed = with_spec(
        EXAMPLE,
        scheduler={**EXAMPLE["spec"]["scheduler"], "maxNumSeqs": 64, "preemptionMode": "swap"},
        slaTiers=[{"name": "gold", "priority": 0, "ttftTargetMs": 100}],
    )
    after = build(changed, generation=2)
    assert after["Deployment", "chat-70b"] == before["Deployment", "chat-70b"]
    assert after["ConfigMap", "chat-70b-scheduler"] != before["ConfigMap", "chat-70b-scheduler"]
    unchanged = [k for k in before if k != ("ConfigMap", "chat-70b-scheduler")]
    assert all(after[k] == before[k] for k in unchanged)


def test_an_engine_change_rolls_the_pods() -> None:
    changed = with_spec(EXAMPLE, engine={**EXAMPLE["spec"]["engine"], "maxModelLen": 4096})
    before = build(EXAMPLE)["Deployment", "chat-70b"]["spec"]["template"]
    assert build(changed)["Deployment", "chat-70b"]["spec"]["template"] != before


# -- the ConfigMap: what `iterserve serve --config` reads ---------------------------------


@pytest.mark.parametrize("document", [EXAMPLE, MINIMAL], ids=["example", "minimal"])
def test_config_map_reads_back_as_serve_reads_it(document: dict[str, Any], tmp_path: Path) -> None:
    """The settings file goes through ``iterserve serve``'s own path (its parser, the
    ``--config`` loader with serve's classes, the flags given winning) and starts a server at
    exactly the desired settings and version."""
    name, spec = document["metadata"]["name"], parse_spec(document["spec"])
    meta = document["metadata"]
    ctx = Context(name, meta["namespace"], generation=9, config_version=7)
    config_map, _, _, deployment, *_ = build_all(ctx, spec)
    assert config_map["metadata"]["name"] == f"{name}-scheduler"
    assert list(config_map["data"]) == ["scheduler.yaml"]
    settings_file = tmp_path / "scheduler.yaml"
    settings_file.write_text(config_map["data"]["scheduler.yaml"])
    args = list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    args[args.index("--config") + 1] = str(settings_file)
    parser = build_parser()
    parsed = parser.parse_args(args)
    classes = (*ENGINE_CONFIG_CLASSES, ServerConfig, SimulationConfig)
    kwargs = engine_kwargs(parsed, parser, classes)
    server_names = {f for f in ServerConfig.__dataclass_fields__}
    server = ServerConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in server_names})
    sim_names = set(SimulationConfig.__dataclass_fields__)
    assert not sim_names & set(kwargs)
    engine = EngineConfig.from_kwargs(**kwargs)
    assert server.config_version == 7
    desired = desired_settings(spec)
    assert settings_view(engine.scheduler) == desired
    assert settings_hash(engine.scheduler) == settings_hash_of(desired)


def test_config_map_version_defaults_to_the_generation() -> None:
    data = build(MINIMAL, generation=5)["ConfigMap", "tiny-scheduler"]["data"]["scheduler.yaml"]
    assert yaml.safe_load(data)["config_version"] == 5


# -- Services, router, RBAC, PDB -----------------------------------------------------------


def test_services() -> None:
    objects = build(EXAMPLE)
    assert objects["Service", "chat-70b-server"]["spec"] == {
        "clusterIP": "None",
        "selector": selector("chat-70b", "server"),
        "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
    }
    assert objects["Service", "chat-70b-router"]["spec"] == {
        "selector": selector("chat-70b", "router"),
        "ports": [{"name": "http", "port": 8080, "targetPort": "http"}],
    }


def test_router_deployment() -> None:
    document = with_spec(EXAMPLE, router={"replicas": 2, "policy": "session"})
    deployment = build(document)["Deployment", "chat-70b-router"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"] == {"matchLabels": selector("chat-70b", "router")}
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"] == labels("chat-70b", "router")
    assert pod["spec"]["serviceAccountName"] == "chat-70b-router"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == CONTROL_IMAGE
    args = container["args"]
    assert args[0] == "router"
    for flag, value in (
        ("--k8s-service", "chat-70b-server"),
        ("--namespace", "serving"),
        ("--k8s-port-name", "http"),
        ("--policy", "session"),
        ("--port", "8080"),
    ):
        assert args[args.index(flag) + 1] == value
    parsed = build_parser().parse_args(args)
    assert (parsed.k8s_service, parsed.namespace, parsed.policy) == (
        "chat-70b-server",
        "serving",
        "session",
    )
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    key = {"secretKeyRef": {"name": "chat-70b-api-key", "key": "api-key"}}
    # Clients' key from N-api-key; the replicas are sent the router token (a file).
    assert container["env"] == [{"name": "ITERSERVE_API_KEY", "valueFrom": key}]
    assert parsed.router_token_file == "/var/run/iterserve/router-token/token"
    assert container["volumeMounts"] == [
        {"name": "router-token", "mountPath": "/var/run/iterserve/router-token", "readOnly": True}
    ]
    assert pod["spec"]["volumes"] == [
        {
            "name": "router-token",
            "secret": {
                "secretName": "chat-70b-router-token",
                "items": [{"key": "token", "path": "token"}],
            },
        }
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    grace = parsed.shutdown_grace_period_s
    assert pod["spec"]["terminationGracePeriodSeconds"] > 5 + grace + ABORT_WAIT_S
    custom = with_spec(EXAMPLE, router={"image": "ghcr.io/example/router:1"})
    router = build(custom)["Deployment", "chat-70b-router"]["spec"]["template"]["spec"]
    assert router["containers"][0]["image"] == "ghcr.io/example/router:1"


def test_api_keys_secret_is_mounted_on_router_and_server_with_their_flags() -> None:
    """spec.auth.apiKeysSecret: its keys.yaml and the router token mounted as files (a Secret
    volume is updated in place, so both re-read them) and named by the same flags on the
    router and the server; the one generated key (N-api-key) is no longer used."""
    objects = build(with_spec(EXAMPLE, auth={"apiKeysSecret": "team-keys"}))
    expected_volumes = [
        {
            "name": "router-token",
            "secret": {
                "secretName": "chat-70b-router-token",
                "items": [{"key": "token", "path": "token"}],
            },
        },
        {
            "name": "api-keys",
            "secret": {
                "secretName": "team-keys",
                "items": [{"key": "keys.yaml", "path": "keys.yaml"}],
            },
        },
    ]
    files = {
        "router_token_file": "/var/run/iterserve/router-token/token",
        "api_keys_file": "/var/run/iterserve/api-keys/keys.yaml",
    }
    for name in ("chat-70b", "chat-70b-router"):
        pod = objects["Deployment", name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        secret_volumes = [v for v in pod["volumes"] if "secret" in v]
        admin = [{"name": "admin-token", "secret": {"secretName": "chat-70b-admin"}}]
        assert secret_volumes == expected_volumes + ([] if name.endswith("-router") else admin)
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["api-keys"] == {
            "name": "api-keys",
            "mountPath": "/var/run/iterserve/api-keys",
            "readOnly": True,
        }
        parsed = build_parser().parse_args(container["args"])
        assert {k: getattr(parsed, k) for k in files} == files
        env = [e["name"] for e in container.get("env", [])]
        assert "ITERSERVE_API_KEY" not in env and "ITERSERVE_BACKEND_API_KEY" not in env
        if name.endswith("-router"):  # none at all: an empty list would read back drifted
            assert "env" not in container
    with pytest.raises(SpecError, match=r"spec\.auth\.apiKeysSecret"):
        parse_spec(with_spec(EXAMPLE, auth={"apiKeysSecret": "Not_A_Name"})["spec"])


def test_router_rbac_reads_endpoint_slices_only() -> None:
    objects = build(EXAMPLE)
    assert "rules" not in objects["ServiceAccount", "chat-70b-router"]
    assert objects["Role", "chat-70b-router"]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = objects["RoleBinding", "chat-70b-router"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "chat-70b-router",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "chat-70b-router", "namespace": "serving"}
    ]


def test_pod_disruption_budget() -> None:
    assert build(EXAMPLE)["PodDisruptionBudget", "chat-70b"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": selector("chat-70b", "server")},
    }


# -- autoscalers ---------------------------------------------------------------------------


def test_no_autoscaler_while_disabled() -> None:
    kinds = {kind for kind, _ in build(EXAMPLE)}
    assert not kinds & {"HorizontalPodAutoscaler", "ScaledObject"}


def test_hpa_on_queue_depth() -> None:
    objects = build(with_spec(EXAMPLE, autoscaling=HPA))
    assert list(objects)[-1] == ("HorizontalPodAutoscaler", "chat-70b")
    hpa = objects["HorizontalPodAutoscaler", "chat-70b"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "chat-70b",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "iterserve_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "8"},
            },
        }
    ]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


@pytest.mark.parametrize(
    ("depth", "canonical"), [(8, "8"), (8.0, "8"), (2.5, "2500m"), (0.1, "100m"), (0.0025, "2500u")]
)
def test_hpa_target_is_a_canonical_quantity(depth: float, canonical: str) -> None:
    """The API server stores quantities canonically; a built "2.5" would read back "2500m"
    and ``apply`` would patch the HPA on every pass."""
    assert quantity(depth) == canonical
    hpa = build(with_spec(EXAMPLE, autoscaling={**HPA, "targetQueueDepth": depth}))
    metric = hpa["HorizontalPodAutoscaler", "chat-70b"]["spec"]["metrics"][0]
    assert metric["pods"]["target"]["averageValue"] == canonical


def test_keda_scaled_object() -> None:
    """Scaled to zero (``minReplicas: 0``): the queue trigger and the router's wake trigger
    (their semantics are tested on simulated replicas in test_autoscaling.py)."""
    objects = build(with_spec(EXAMPLE, autoscaling=KEDA))
    assert list(objects)[-1] == ("ScaledObject", "chat-70b")
    scaled = objects["ScaledObject", "chat-70b"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"name": "chat-70b"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 3)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 300)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 300},
    }
    queue, wake = spec["triggers"]
    url = "http://prometheus.monitoring.svc:9090"
    assert queue == {
        "type": "prometheus",
        "name": "queue",
        "metadata": {
            "serverAddress": url,
            "query": 'sum(iterserve_num_requests_waiting{namespace="serving",'
            'pod=~"chat-70b-[a-z0-9]+-[a-z0-9]+"})',
            "threshold": "2.5",
            "activationThreshold": "0",
        },
    }
    assert wake == {
        "type": "prometheus",
        "name": "wake",
        "metadata": {
            "serverAddress": url,
            "query": 'clamp_max((sum(rate(iterserve_router_requests_total{namespace="serving",'
            'pod=~"chat-70b-router-[a-z0-9]+-[a-z0-9]+"}[2m])) or vector(0)) + '
            '(sum(iterserve_router_held_requests{namespace="serving",'
            'pod=~"chat-70b-router-[a-z0-9]+-[a-z0-9]+"}) or vector(0)), 1)',
            "threshold": "1",
            "activationThreshold": "0",
        },
    }
    for trigger in (queue, wake):  # KEDA's metadata: strings
        assert all(isinstance(v, str) for v in trigger["metadata"].values())


def test_keda_from_one_replica_has_no_wake_trigger() -> None:
    scaled = build(with_spec(EXAMPLE, autoscaling={**KEDA, "minReplicas": 1}))
    spec = scaled["ScaledObject", "chat-70b"]["spec"]
    assert spec["minReplicaCount"] == 1
    assert [t["name"] for t in spec["triggers"]] == ["queue"]


@pytest.mark.parametrize(
    ("depth", "threshold"),
    [(123456.7, "123456.7"), (999999, "999999"), (0.1234567, "0.1234567"), (1e-7, "0.0000001")],
)
def test_keda_threshold_keeps_every_digit(depth: float, threshold: str) -> None:
    """No exponent and no rounding (":g" made 999999 "1e+06" and 123456.7 "123457")."""
    autoscaling = {**KEDA, "minReplicas": 1, "targetQueueDepth": depth}
    spec = build(with_spec(EXAMPLE, autoscaling=autoscaling))["ScaledObject", "chat-70b"]["spec"]
    assert spec["triggers"][0]["metadata"]["threshold"] == threshold


def test_target_queue_depth_has_a_maximum() -> None:
    with pytest.raises(SpecError, match="targetQueueDepth"):
        build(with_spec(EXAMPLE, autoscaling={**KEDA, "targetQueueDepth": 1e300}))


@pytest.mark.parametrize(
    ("autoscaling", "path"),
    [(None, "/ready"), (HPA, "/ready"), ({**KEDA, "minReplicas": 1}, "/ready"), (KEDA, "/health")],
    ids=["off", "hpa", "keda-from-one", "keda-to-zero"],
)
def test_router_stays_ready_without_server_pods_only_when_scaled_to_zero(
    autoscaling: dict[str, Any] | None, path: str
) -> None:
    """The router's /ready fails with no ready server pod; scaled to zero it must stay in its
    Service to answer (and count) the requests that wake the server pods."""
    document = with_spec(EXAMPLE, autoscaling=autoscaling) if autoscaling else EXAMPLE
    pod = build(document)["Deployment", "chat-70b-router"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"] == {"path": path, "port": "http"}


def test_scale_to_zero_needs_the_router() -> None:
    with pytest.raises(SpecError, match=r"needs router.replicas >= 1"):
        parse_spec(with_spec(EXAMPLE, autoscaling=KEDA, router={"replicas": 0})["spec"])


# -- schema validation ---------------------------------------------------------------------


def _variants() -> list[tuple[str, dict[str, Any]]]:
    uri = {"uri": "s3://bucket/tiny", "initImage": "ghcr.io/example/fetch:1"}
    return [
        ("example", EXAMPLE),
        ("minimal", MINIMAL),
        ("hpa", with_spec(EXAMPLE, autoscaling=HPA)),
        ("keda", with_spec(MINIMAL, autoscaling=KEDA)),
        ("keda-from-one", with_spec(MINIMAL, autoscaling={**KEDA, "minReplicas": 1})),
        ("uri", with_spec(MINIMAL, model={"name": "tiny", "source": uri})),
        ("image", with_spec(MINIMAL, model={"name": "tiny", "source": {"image": {"path": "/m"}}})),
    ]


@pytest.mark.parametrize(
    "document", [d for _, d in _variants()], ids=[name for name, _ in _variants()]
)
def test_every_object_is_valid_for_kubernetes_1_33(document: dict[str, Any]) -> None:
    for obj in build(document).values():
        if obj["kind"] == "ScaledObject":
            # kubernetes-validate has no schema for custom resources: it raises
            # SchemaNotFoundError for KEDA's kind (checked here so that a version that does
            # ship one gets used); the ScaledObject's fields are checked in test_keda_*.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, "1.33", strict=True)
            continue
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_the_schema_check_is_not_a_no_op() -> None:
    deployment = copy.deepcopy(build(EXAMPLE)["Deployment", "chat-70b"])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)


# -- iterserve operator render -------------------------------------------------------------


def test_render_prints_every_object_in_order(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli_main(["operator", "render", str(EXAMPLE_FILE)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("apiVersion: v1\nkind: ConfigMap\n")
    assert out.count("\n---\n") == len(KINDS_IN_ORDER) - 1
    documents = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in documents] == KINDS_IN_ORDER
    assert documents == list(build(EXAMPLE).values())
    assert all("ownerReferences" not in d["metadata"] for d in documents)
    assert "scheduler.yaml: |" in out  # the settings file as a literal block

    scaled = tmp_path / "keda.yaml"
    scaled.write_text(yaml.safe_dump(with_spec(EXAMPLE, autoscaling=KEDA)))
    assert cli_main(["operator", "render", str(scaled)]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds == [*KINDS_IN_ORDER, "ScaledObject"]


def test_render_namespace_as_kubectl_apply_n(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``-n NS`` places a document that names no namespace (the examples/ files) in NS, as
    ``kubectl apply -n NS`` does; a document in another namespace is an error."""
    unplaced = tmp_path / "unplaced.yaml"
    meta = {k: v for k, v in EXAMPLE["metadata"].items() if k != "namespace"}
    unplaced.write_text(yaml.safe_dump({**EXAMPLE, "metadata": meta}))
    assert cli_main(["operator", "render", "-n", "team-a", str(unplaced)]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in documents} == {"team-a"}
    assert cli_main(["operator", "render", str(unplaced)]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in documents} == {"default"}
    placed = tmp_path / "placed.yaml"
    placed.write_text(yaml.safe_dump(EXAMPLE))
    assert cli_main(["operator", "render", "--namespace", "team-a", str(placed)]) == 1
    assert "not --namespace team-a" in capsys.readouterr().err


def _invalid_documents() -> list[tuple[str, str, str]]:
    """(id, file text, a phrase of the reason)."""
    tokens = with_spec(EXAMPLE, scheduler={"maxNumSeqs": 256, "maxNumBatchedTokens": 128})
    infinite = with_spec(EXAMPLE, slaTiers=[{"name": "gold", "priority": 0, "ttftTargetMs": 1}])
    infinite_text = yaml.safe_dump(infinite).replace("ttftTargetMs: 1", "ttftTargetMs: .inf")
    aging = with_spec(EXAMPLE, scheduler={"agingIntervalS": 0.0001})
    duplicate = with_spec(
        EXAMPLE, slaTiers=[{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]
    )
    return [
        ("tokens", yaml.safe_dump(tokens), "maxNumBatchedTokens must be >= scheduler.maxNumSeqs"),
        ("tier-inf", infinite_text, "server would refuse"),
        ("aging", yaml.safe_dump(aging), "aging_interval_s"),
        ("tier-names", yaml.safe_dump(duplicate), "names must be unique"),
        ("kind", yaml.safe_dump({**EXAMPLE, "kind": "Deployment"}), "kind: LLMDeployment"),
        ("unknown-field", yaml.safe_dump(with_spec(EXAMPLE, gpus=4)), "spec.gpus"),
        ("yaml", "spec: [unclosed\n", "error"),
        ("empty", "", "no LLMDeployment"),
        ("only-separators", "---\n---\n", "no LLMDeployment"),
        ("not-a-mapping", "- a\n- b\n", "kind: LLMDeployment"),
        ("api-version", yaml.safe_dump({**EXAMPLE, "apiVersion": "iterserve.io/v1"}), "apiVersion"),
        ("no-name", yaml.safe_dump({**EXAMPLE, "metadata": {"namespace": "x"}}), "metadata.name"),
        ("metadata-string", yaml.safe_dump({**EXAMPLE, "metadata": "chat"}), "metadata: expected"),
        ("spec-string", yaml.safe_dump({**EXAMPLE, "spec": "x"}), "spec: expected a mapping"),
        (
            "generation",
            yaml.safe_dump({**EXAMPLE, "metadata": {"name": "a", "generation": "x"}}),
            "metadata.generation",
        ),
        ("name", yaml.safe_dump({**EXAMPLE, "metadata": {"name": "9lives"}}), "DNS-1035"),
        (
            "namespace",
            yaml.safe_dump({**EXAMPLE, "metadata": {"name": "a", "namespace": "A B"}}),
            "metadata.namespace",
        ),
        ("twice", yaml.safe_dump_all([EXAMPLE, EXAMPLE]), "two LLMDeployments named chat-70b"),
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [(t, r) for _, t, r in _invalid_documents()],
    ids=[i for i, _, _ in _invalid_documents()],
)
def test_render_refuses_an_invalid_spec(
    text: str, reason: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli_main(["operator", "render", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert reason in err
    assert err.startswith("iterserve operator render: ")


def test_render_of_a_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["operator", "render", str(tmp_path / "absent.yaml")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "absent.yaml" in err


def test_render_of_a_binary_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    assert cli_main(["operator", "render", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("iterserve operator render: error: ")


# -- desired settings against the server ---------------------------------------------------


@pytest.mark.parametrize("document", [EXAMPLE, MINIMAL], ids=["example", "minimal"])
def test_desired_settings_hash_as_the_server_computes_it(document: dict[str, Any]) -> None:
    spec = parse_spec(document["spec"])
    desired = desired_settings(spec)
    # The PUT body as the pod receives it (JSON), onto a server at the CPU engine's defaults.
    body = json.loads(json.dumps({**desired, "config_version": 7}))
    merged = merge(
        VersionedSettings(SchedulerConfig(), 1),
        body,
        swap_space=spec.engine.swapSpace,
        max_model_len=spec.engine.maxModelLen or 0,
    )
    assert merged is not None
    view = merged.view()
    assert view["config_version"] == 7
    assert view["config_hash"] == settings_hash_of(desired)
    assert {k: v for k, v in view.items() if k not in ("config_version", "config_hash")} == desired
    # Sent again: a no-op, as a second reconcile must be.
    assert merge(merged, body, spec.engine.swapSpace, spec.engine.maxModelLen or 0) is None


def test_desired_settings_of_the_example() -> None:
    assert desired_settings(parse_spec(EXAMPLE["spec"])) == {
        "max_num_seqs": 128,
        "max_num_batched_tokens": 2048,
        "long_prefill_token_threshold": 512,
        "kv_watermark": 0.01,
        "preemption_mode": "auto",
        "aging_interval_s": 5.0,
        "priority_preemption_margin": 0,
        "max_waiting": 1024,
        "max_waiting_per_tenant": None,
        "tiers": [
            {"name": "premium", "priority": 0, "max_queue_wait_ms": 500.0, "ttft_target_ms": 200.0},
            {
                "name": "standard",
                "priority": 1,
                "max_queue_wait_ms": None,
                "ttft_target_ms": 1000.0,
            },
            {
                "name": "best-effort",
                "priority": 2,
                "max_queue_wait_ms": None,
                "ttft_target_ms": None,
            },
        ],
    }


def test_default_tiers_when_sla_tiers_are_absent() -> None:
    tiers = desired_settings(parse_spec(MINIMAL["spec"]))["tiers"]
    assert [(t["name"], t["priority"]) for t in tiers] == [
        ("premium", 0),
        ("standard", 1),
        ("best-effort", 2),
    ]


def test_priority_preemption_margin_is_pushed_as_the_live_setting() -> None:
    spec = LLMDeploymentSpec.model_validate(
        {**MINIMAL["spec"], "scheduler": {"priorityPreemptionMargin": 2}}
    )
    assert desired_settings(spec)["priority_preemption_margin"] == 2
    with pytest.raises(pydantic.ValidationError, match="priorityPreemptionMargin"):
        LLMDeploymentSpec.model_validate(
            {**MINIMAL["spec"], "scheduler": {"priorityPreemptionMargin": -1}}
        )


def test_max_waiting_per_tenant_is_written_and_pushed_as_the_live_setting() -> None:
    assert desired_settings(parse_spec(MINIMAL["spec"]))["max_waiting_per_tenant"] is None  # off
    document = with_spec(MINIMAL, scheduler={"maxWaiting": 64, "maxWaitingPerTenant": 16})
    desired = desired_settings(parse_spec(document["spec"]))
    assert desired["max_waiting_per_tenant"] == 16
    data = build(document)["ConfigMap", "tiny-scheduler"]["data"]["scheduler.yaml"]
    assert yaml.safe_load(data)["max_waiting_per_tenant"] == 16  # new pods start with it
    # The push's body, onto a pod without the cap: the server applies it.
    body = json.loads(json.dumps({**desired, "config_version": 2}))
    merged = merge(VersionedSettings(SchedulerConfig(), 1), body, 4.0, 0)
    assert merged is not None and merged.config.max_waiting_per_tenant == 16
    assert merged.view()["config_hash"] == settings_hash_of(desired)
    with pytest.raises(SpecError, match=r"maxWaitingPerTenant must be <= scheduler\.maxWaiting"):
        parse_spec(
            with_spec(MINIMAL, scheduler={"maxWaiting": 8, "maxWaitingPerTenant": 9})["spec"]
        )
    with pytest.raises(SpecError, match="maxWaitingPerTenant"):
        parse_spec(with_spec(MINIMAL, scheduler={"maxWaitingPerTenant": 0})["spec"])


@pytest.mark.parametrize(
    "changes",
    [
        {"scheduler": {"agingIntervalS": 0.0001}},
        {"slaTiers": [{"name": "gold", "priority": 0, "maxQueueWaitMs": float("inf")}]},
    ],
    ids=["aging", "tier-inf"],
)
def test_settings_the_server_would_refuse_raise_spec_error(changes: dict[str, Any]) -> None:
    spec = LLMDeploymentSpec.model_validate({**MINIMAL["spec"], **changes})
    with pytest.raises(SpecError, match="the server would refuse"):
        desired_settings(spec)


# -- apply: idempotent against an in-memory API server -------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FakeKube(Kube):
    """Objects by (kind, namespace, name); every call recorded. The API server's additions
    are played by a uid, a resourceVersion and a defaulted field on create."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any | None:
        self.calls.append(("get", kind, name))
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found)

    async def create(self, body: dict[str, Any]) -> Any:
        meta = body["metadata"]
        self.calls.append(("create", body["kind"], meta["name"]))
        key = (body["kind"], meta["namespace"], meta["name"])
        assert key not in self.objects, "create of an existing object (409)"
        live = json.loads(json.dumps(body))
        live["metadata"] |= {"uid": f"uid-{len(self.objects)}", "resourceVersion": "1"}
        if body["kind"] == "Deployment":
            live["spec"]["progressDeadlineSeconds"] = 600
            live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/x"
        self.objects[key] = live
        return copy.deepcopy(live)

    async def patch(self, body: dict[str, Any]) -> Any:
        meta = body["metadata"]
        self.calls.append(("patch", body["kind"], meta["name"]))
        key = (body["kind"], meta["namespace"], meta["name"])
        self.objects[key] = merge_patch(self.objects[key], json.loads(json.dumps(body)))
        return copy.deepcopy(self.objects[key])


def apply_all(kube: FakeKube, objects: list[dict[str, Any]]) -> list[str]:
    async def run() -> list[str]:
        return [await apply(kube, obj) for obj in objects]

    return asyncio.run(run())


def test_apply_creates_then_changes_nothing() -> None:
    kube = FakeKube()
    objects = list(build(with_spec(EXAMPLE, autoscaling=HPA)).values())
    assert apply_all(kube, objects) == ["created"] * len(objects)
    creates = [c for c in kube.calls if c[0] == "create"]
    assert creates == [("create", o["kind"], o["metadata"]["name"]) for o in objects]
    kube.calls.clear()
    assert apply_all(kube, objects) == ["unchanged"] * len(objects)
    assert all(verb == "get" for verb, _, _ in kube.calls)


def test_apply_patches_drift_and_leaves_additions_alone() -> None:
    kube = FakeKube()
    objects = list(build(EXAMPLE).values())
    apply_all(kube, objects)
    deployment = kube.objects["Deployment", "serving", "chat-70b"]
    deployment["spec"]["replicas"] = 3  # scaled by hand
    config_map = kube.objects["ConfigMap", "serving", "chat-70b-scheduler"]
    config_map["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied"] = "{}"
    kube.calls.clear()
    results = apply_all(kube, objects)
    assert results == ["unchanged"] * 3 + ["patched"] + ["unchanged"] * (len(objects) - 4)
    assert [c for c in kube.calls if c[0] == "patch"] == [("patch", "Deployment", "chat-70b")]
    deployment = kube.objects["Deployment", "serving", "chat-70b"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["metadata"]["uid"] == "uid-3"  # patched in place, not recreated
    assert apply_all(kube, objects) == ["unchanged"] * len(objects)


def test_apply_deletes_what_the_operator_stopped_setting() -> None:
    """Three-way: a key taken out of the spec goes from the live object; keys others set
    stay."""
    kube = FakeKube()
    document = with_spec(EXAMPLE)
    pod = document["spec"].setdefault("pod", {})
    pod["nodeSelector"] = {"gpu": "h100"}
    apply_all(kube, list(build(document).values()))
    deployment = kube.objects["Deployment", "serving", "chat-70b"]
    deployment["metadata"]["annotations"]["someone.else/note"] = "keep"
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    del pod["nodeSelector"]
    apply_all(kube, list(build(document).values()))
    deployment = kube.objects["Deployment", "serving", "chat-70b"]
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]
    assert deployment["metadata"]["annotations"]["someone.else/note"] == "keep"


def test_apply_of_a_changed_spec_patches_only_what_changed() -> None:
    kube = FakeKube()
    apply_all(kube, list(build(EXAMPLE, generation=1).values()))
    changed = with_spec(EXAMPLE, scheduler={**EXAMPLE["spec"]["scheduler"], "maxNumSeqs": 64})
    objects = list(build(changed, generation=2).values())
    assert apply_all(kube, objects) == ["patched"] + ["unchanged"] * (len(objects) - 1)
    data = kube.objects["ConfigMap", "serving", "chat-70b-scheduler"]["data"]["scheduler.yaml"]
    assert yaml.safe_load(data)["max_num_seqs"] == 64
    assert yaml.safe_load(data)["config_version"] == 2


def test_is_subset() -> None:
    assert is_subset({"a": 1}, {"a": 1, "b": 2})
    assert not is_subset({"a": 1, "b": 2}, {"a": 1})
    assert is_subset({"a": {"b": [1, {"c": 2}]}}, {"a": {"b": [1, {"c": 2, "d": 3}], "e": 4}})
    assert not is_subset({"a": [1, 2]}, {"a": [1, 2, 3]})  # lists match item by item
    assert not is_subset({"a": [1, 2]}, {"a": [2, 1]})
    assert is_subset({"limits": {"nvidia.com/gpu": 4}}, {"limits": {"nvidia.com/gpu": "4"}})
    assert is_subset({"x": 1}, {"x": 1.0}) and not is_subset({"x": 1}, {"x": 2})
    assert not is_subset({"a": {}}, {"a": None}) and not is_subset({"a": []}, {})


# -- the pods live settings are pushed to --------------------------------------------------


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    ready: str = "True",
    ports: list[dict[str, Any]] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": ready},
        ]
    }
    if ip is not None:
        status["podIP"] = ip
    if ports is None:
        ports = [
            {"name": "metrics", "containerPort": 9000},
            {"name": "http", "containerPort": 8000},
        ]
    containers = [{"name": "sidecar"}, {"name": "server", "ports": ports}]
    return {"metadata": meta, "spec": {"containers": containers}, "status": status}


def test_ready_targets_only_ready_running_pods_with_an_http_port() -> None:
    pods = [
        pod("ok", ip="10.0.0.1"),
        pod("not-ready", ready="False"),
        pod("unknown", ready="Unknown"),
        pod("no-ip", ip=None),
        pod("terminating", deleting=True),
        pod("no-http", ports=[{"name": "grpc", "containerPort": 9000}]),
        pod("other-port", ip="10.0.0.2", ports=[{"name": "http", "containerPort": 8123}]),
        {"metadata": {"name": "bare"}},
    ]
    assert ready_targets(pods) == [
        PodTarget("ok", "http://10.0.0.1:8000"),
        PodTarget("other-port", "http://10.0.0.2:8123"),
    ]


# -- conditions ----------------------------------------------------------------------------

OLD = "2020-01-01T00:00:00Z"


def test_condition_keeps_its_transition_time_while_the_status_holds() -> None:
    previous = [{"type": "Ready", "status": "False", "lastTransitionTime": OLD}]
    same = condition(previous, "Ready", "False", "Other", "a new message", 3)
    assert same == {
        "type": "Ready",
        "status": "False",
        "reason": "Other",
        "message": "a new message",
        "lastTransitionTime": OLD,
        "observedGeneration": 3,
    }
    flipped = condition(previous, "Ready", "True", "ReplicasReady", "1 of 1", 3)
    assert flipped["lastTransitionTime"] > OLD
    assert len(flipped["lastTransitionTime"]) == len(OLD)
    new = condition([], "Progressing", "True", "RollingOut", "", 1)
    assert new["lastTransitionTime"].endswith("Z")


def test_invalid_status_keeps_transition_times() -> None:
    body = {"metadata": {"name": "chat-70b", "generation": 4}, "status": {}}
    first = invalid_status(body, "spec.x: bad")
    assert first["observedGeneration"] == 4
    conditions = first["conditions"]
    assert [(c["type"], c["status"], c["reason"]) for c in conditions] == [
        ("Ready", "False", "InvalidSpec"),
        ("Progressing", "False", "InvalidSpec"),
        ("SchedulerConfigApplied", "False", "InvalidSpec"),
    ]
    assert all(c["message"] == "spec.x: bad" and c["observedGeneration"] == 4 for c in conditions)
    aged = [{**c, "lastTransitionTime": OLD} for c in conditions]
    again = invalid_status({**body, "status": {"conditions": aged}}, "spec.y: also bad")
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [OLD] * 3
    assert all(c["message"] == "spec.y: also bad" for c in again["conditions"])
    # Ready was True before: it turns False now, and its transition time moves.
    was_ready = [{**aged[0], "status": "True"}, *aged[1:]]
    turned = invalid_status({**body, "status": {"conditions": was_ready}}, "bad")
    times = [c["lastTransitionTime"] for c in turned["conditions"]]
    assert times[0] > OLD and times[1:] == [OLD, OLD]


def test_ready_targets_take_the_admin_port_for_the_push() -> None:
    ports = [{"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": 8001}]
    (target,) = ready_targets([pod("ok", ip="10.0.0.1", ports=ports)])
    assert target == PodTarget("ok", "http://10.0.0.1:8000", "http://10.0.0.1:8001")
    assert target.admin == "http://10.0.0.1:8001"
    assert PodTarget("old", "http://10.0.0.2:8000").admin == "http://10.0.0.2:8000"


# -- the admin port, its token volume, NetworkPolicies -------------------------------------


def test_admin_port_is_in_no_service_and_its_token_is_a_secret_volume() -> None:
    objects = build(EXAMPLE)
    for kind, name in objects:
        if kind == "Service":
            assert [p["port"] for p in objects[kind, name]["spec"]["ports"]] in ([8000], [8080])
    container = server_container(EXAMPLE)
    assert not any(e["name"] == "ITERSERVE_ADMIN_TOKEN" for e in container["env"])
    args = build_parser().parse_args(container["args"])
    assert (args.admin_port, args.admin_token_file) == (
        8001,
        "/var/run/secrets/iterserve.io/admin/token",
    )
    volume = {"name": "admin-token", "secret": {"secretName": "chat-70b-admin"}}
    assert volume in server_pod(EXAMPLE)["spec"]["volumes"]
    mount = {"name": "admin-token", "mountPath": "/var/run/secrets/iterserve.io/admin",
             "readOnly": True}  # fmt: skip
    assert mount in container["volumeMounts"]


def test_network_policies_select_the_peers_and_ports() -> None:
    document = with_spec(EXAMPLE, networkPolicy={"apiFrom": ["monitoring", "batch-jobs"]})
    spec, meta = parse_spec(document["spec"]), document["metadata"]
    operator = (("app.kubernetes.io/instance", "ops"), ("app.kubernetes.io/component", "operator"))
    ctx = Context(meta["name"], meta["namespace"], operator_namespace="iterserve-system",
                  operator_labels=operator)  # fmt: skip
    by_name = {
        o["metadata"]["name"]: o for o in build_all(ctx, spec) if o["kind"] == "NetworkPolicy"
    }
    server, router = by_name["chat-70b-server"]["spec"], by_name["chat-70b-router"]["spec"]
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "iterserve-system"}},
        "podSelector": {"matchLabels": dict(operator)},
    }
    assert server["podSelector"] == {"matchLabels": selector("chat-70b", "server")}
    assert server["policyTypes"] == ["Ingress"]
    api, admin, kv_events = server["ingress"]
    assert api["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert api["from"] == [
        {"podSelector": {"matchLabels": selector("chat-70b", "router")}},
        operator_peer,
        {"namespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In",
            "values": ["monitoring", "batch-jobs"]}]}},
    ]  # fmt: skip
    assert admin == {"from": [operator_peer], "ports": [{"protocol": "TCP", "port": 8001}]}
    # KV events: the router and the apiFrom namespaces (another picker may subscribe).
    assert kv_events == {"from": [api["from"][0], api["from"][2]],
                         "ports": [{"protocol": "TCP", "port": 5557}]}  # fmt: skip
    assert router == {
        "podSelector": {"matchLabels": selector("chat-70b", "router")},
        "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8080}]}],
    }
    for policy in by_name.values():
        kubernetes_validate.validate(policy, "1.33", strict=True)


def test_network_policies_default_to_the_charts_operator_labels_and_can_be_off() -> None:
    objects = build(EXAMPLE)
    (_, admin, _) = objects["NetworkPolicy", "chat-70b-server"]["spec"]["ingress"]
    assert admin["from"] == [{
        "namespaceSelector": {},  # render knows no operator namespace: any
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "iterserve",
                                        "app.kubernetes.io/component": "operator"}},
    }]  # fmt: skip
    off = build(with_spec(EXAMPLE, networkPolicy={"enabled": False}))
    assert not any(kind == "NetworkPolicy" for kind, _ in off)
    with pytest.raises(SpecError, match="apiFrom"):
        parse_spec({**EXAMPLE["spec"], "networkPolicy": {"apiFrom": ["Not_A_Namespace"]}})
