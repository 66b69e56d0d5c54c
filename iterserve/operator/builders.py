"""Pure builders: the Kubernetes objects an ``LLMDeployment`` owns, as plain mappings.

No cluster and no kopf here: the handlers (:mod:`iterserve.operator.handlers`) add owner
references and apply what these return, and ``iterserve operator render`` prints it.
Names derive from the resource's name ``N`` (docs/kubernetes.md): ConfigMap ``N-scheduler``, server
Deployment ``N`` behind the headless Service ``N-server``, PodDisruptionBudget ``N``, HPA or KEDA
ScaledObject ``N``, NetworkPolicy ``N-server``; the router's ServiceAccount, Role and RoleBinding
``N-router`` (both modes); in ``spec.router.mode`` proxy the router Deployment and Service,
NetworkPolicy and (from 2 replicas) PodDisruptionBudget ``N-router``; in endpointPicker mode the
InferencePool ``N`` and the picker's Deployment, Service, NetworkPolicy and PodDisruptionBudget
``N-epp`` instead (one builder makes both Deployments: the picker is ``iterserve router --mode
endpoint-picker``, with the router's arguments, credentials and ServiceAccount); the Secrets
``N-admin`` (key ``token``: the admin tokens, one per line, the current one first),
``N-api-key`` (key ``api-key``) and ``N-router-token`` (key ``token``) are referenced, and
created by the operator when absent; ``spec.auth.apiKeysSecret`` (key ``keys.yaml``) is the user's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

import yaml

from iterserve.operator.checks import check_name, check_objects_fields, check_server_args
from iterserve.operator.cli_args import DEFAULT_CONTROL_IMAGE
from iterserve.operator.spec import LLMDeploymentSpec, SpecError, desired_settings

SERVER_PORT = 8000
# The server's /admin/* listener (--admin-port): in no Service, reached by the operator only.
ADMIN_PORT = 8001
ROUTER_PORT = 8080
# The endpoint picker's Envoy ext_proc port (GAIE's conventional EPP port) and its Service's
# appProtocol: gRPC without TLS, so the gateway speaks HTTP/2 to it in cleartext.
EPP_GRPC_PORT, EPP_APP_PROTOCOL = 9002, "kubernetes.io/h2c"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
# The servers' KV-cache event publisher (ZMQ PUB, vLLM's default port): always on in the
# operator's pods (DESIGN.md), so a router with spec.router.kvEvents, or another prefix-aware
# picker (llm-d's), can subscribe without the servers restarting.
KV_EVENTS_PORT = 5557
KV_EVENTS_POD_ENV = "POD_NAME"  # the publisher's topic names the pod (iterserve/kv_events.py)
# The N-admin Secret's volume (not under CONFIG_DIR: a mount inside the read-only ConfigMap
# volume needs a mount point the runtime cannot create there).
ADMIN_TOKEN_DIR = "/var/run/secrets/iterserve.io/admin"
ADMIN_TOKEN_KEY = "token"
# The operator's pods as its chart labels them (iterserve operator run --operator-label).
DEFAULT_OPERATOR_LABELS = (
    ("app.kubernetes.io/name", "iterserve"),
    ("app.kubernetes.io/component", "operator"),
)
CONFIG_DIR = "/etc/iterserve"
CONFIG_FILE = "scheduler.yaml"
MODEL_DIR = "/models"
# The server's drain on SIGTERM (iterserve serve --shutdown-grace-period-s), what it waits
# after it (draining.ABORT_WAIT_S), and the preStop pause while endpoints drop the pod.
SERVER_GRACE_S, ABORT_WAIT_S, PRESTOP_SLEEP_S = 30, 5, 5
ROUTER_GRACE_S = 30
# Weights of a 70B model take minutes to load: 15 minutes before liveness counts.
STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES = 10, 90
QUEUE_METRIC = "iterserve_num_requests_waiting"
NON_ROOT_UID = 10001  # the images' user (Dockerfile; docs/images.md)
# Credentials are mounted as files (a Secret volume is updated in place; env is not), so the
# router and the servers re-read them on change: spec.auth.apiKeysSecret and N-router-token.
API_KEYS_DIR, API_KEYS_KEY = "/var/run/iterserve/api-keys", "keys.yaml"
ROUTER_TOKEN_DIR, ROUTER_TOKEN_KEY = "/var/run/iterserve/router-token", "token"


@dataclass(frozen=True)
class Context:
    """What a build needs besides the spec.

    Args:
        name, namespace: the resource's.
        generation: ``metadata.generation`` (the scheduler settings' version in the ConfigMap).
        control_image: the router's image unless ``spec.router.image`` is set.
        config_version: the settings' version (``status.schedulerConfigVersion``, else the
            generation).
        operator_namespace, operator_labels: where the operator's pods run (None: any
            namespace) and their labels: the only peers of the server pods' admin port.
    """

    name: str
    namespace: str
    generation: int = 1
    control_image: str = DEFAULT_CONTROL_IMAGE
    config_version: int | None = None
    operator_namespace: str | None = None
    operator_labels: tuple[tuple[str, str], ...] = DEFAULT_OPERATOR_LABELS


def labels(name: str, component: str) -> dict[str, str]:
    """Labels of every object of resource ``name`` (the selectors use the first three)."""
    return {
        "app.kubernetes.io/name": "iterserve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "iterserve-operator",
    }


def selector(name: str, component: str) -> dict[str, str]:
    full = labels(name, component)
    return {k: full[k] for k in list(full)[:3]}


def _meta(ctx: Context, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ctx.namespace,
        "labels": labels(ctx.name, component),
        **extra,
    }


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


def api_key_secret_name(name: str) -> str:
    return f"{name}-api-key"


def router_token_secret_name(name: str) -> str:
    return f"{name}-router-token"


def server_service_name(name: str) -> str:
    return f"{name}-server"


def router_name(name: str) -> str:
    return f"{name}-router"


def epp_name(name: str) -> str:
    return f"{name}-epp"


def router_url(ctx: Context) -> str:
    return f"http://{router_name(ctx.name)}.{ctx.namespace}.svc:{ROUTER_PORT}"


def picker_mode(spec: LLMDeploymentSpec) -> bool:
    """Whether the resource runs an endpoint picker behind a gateway (an InferencePool)
    instead of the proxy router."""
    return spec.router.mode == "endpointPicker"


def front_component(spec: LLMDeploymentSpec) -> str:
    """The ``app.kubernetes.io/component`` of the pods in front of the servers: ``router``
    (proxy mode) or ``epp`` (endpointPicker mode)."""
    return "epp" if picker_mode(spec) else "router"


# --------------------------------------------------------------------------- scheduler config


def scheduler_file(spec: LLMDeploymentSpec, version: int) -> str:
    """The ConfigMap's ``scheduler.yaml``: the live settings and their version, read by
    ``iterserve serve --config`` at start."""
    return settings_file(desired_settings(spec), version)


def settings_file(settings: dict[str, Any], version: int) -> str:
    """``scheduler.yaml`` of these live settings (the server's keys) at ``version``."""
    return yaml.safe_dump({**settings, "config_version": version}, sort_keys=True)


def config_map(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any]:
    version = ctx.config_version if ctx.config_version is not None else ctx.generation
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(ctx, f"{ctx.name}-scheduler", "server"),
        "data": {CONFIG_FILE: scheduler_file(spec, version)},
    }


# --------------------------------------------------------------------------- server


def _model_volume(spec: LLMDeploymentSpec) -> tuple[str, list[dict[str, Any]], list[Any], Any]:
    """(model directory, volumes, mounts, init container or None) of the model source."""
    source = spec.model.source
    mount = [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}]
    if source.pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claimName}}
        directory = f"{MODEL_DIR}/{source.pvc.path}".rstrip("/")
        return directory, [{**volume}], mount, None
    if source.hostPath is not None:
        volume = {"name": "model", "hostPath": {"path": source.hostPath, "type": "Directory"}}
        return MODEL_DIR, [volume], mount, None
    if source.image is not None:
        return source.image.path, [], [], None
    assert source.uri is not None and source.initImage is not None
    init = {
        "name": "download-model",
        "image": source.initImage,
        "args": [source.uri, MODEL_DIR],
        "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}],
        "securityContext": _container_security(),
    }
    return MODEL_DIR, [{"name": "model", "emptyDir": {}}], mount, init


def server_args(spec: LLMDeploymentSpec, model_dir: str) -> list[str]:
    """``iterserve serve`` arguments of the server container."""
    e = spec.engine
    args = [
        "serve",
        "--host", "0.0.0.0",
        "--port", str(SERVER_PORT),
        "--model", model_dir,
        "--served-model-name", spec.model.name,
        "--config", f"{CONFIG_DIR}/{CONFIG_FILE}",
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--dtype", e.dtype,
        "--block-size", str(e.blockSize),
        "--gpu-memory-utilization", str(e.gpuMemoryUtilization),
        "--swap-space", f"{e.swapSpace:g}",
        "--enable-prefix-caching" if e.enablePrefixCaching else "--no-enable-prefix-caching",
        "--quantization", e.quantization,
        "--kv-cache-dtype", e.kvCacheDtype,
        "--shutdown-grace-period-s", str(SERVER_GRACE_S),
        "--admin-port", str(ADMIN_PORT),
        "--admin-token-file", f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
        # On (the server's default is off): turning the router's subscription on or off
        # (spec.router.kvEvents) then rolls the router pods only.
        "--kv-events-port", str(KV_EVENTS_PORT),
    ]  # fmt: skip
    if e.maxModelLen is not None:
        args += ["--max-model-len", str(e.maxModelLen)]
    return args + _auth_args(spec) + list(spec.pod.extraArgs)


def _auth_args(spec: LLMDeploymentSpec) -> list[str]:
    """The credential files' flags, the same on the router and the server."""
    args = ["--router-token-file", f"{ROUTER_TOKEN_DIR}/{ROUTER_TOKEN_KEY}"]
    if spec.auth.apiKeysSecret is not None:
        args += ["--api-keys-file", f"{API_KEYS_DIR}/{API_KEYS_KEY}"]
    return args


def _auth_volumes(ctx: Context, spec: LLMDeploymentSpec) -> tuple[list[Any], list[Any]]:
    """(volumes, mounts) of the files :func:`_auth_args` names."""
    secrets = [("router-token", router_token_secret_name(ctx.name), ROUTER_TOKEN_KEY)]
    dirs = {"router-token": ROUTER_TOKEN_DIR, "api-keys": API_KEYS_DIR}
    if spec.auth.apiKeysSecret is not None:
        secrets.append(("api-keys", spec.auth.apiKeysSecret, API_KEYS_KEY))
    volumes = [
        {
            "name": volume,
            "secret": {"secretName": secret, "items": [{"key": key, "path": key}]},
        }
        for volume, secret, key in secrets
    ]
    mounts = [
        {"name": volume, "mountPath": dirs[volume], "readOnly": True} for volume, _, _ in secrets
    ]
    return volumes, mounts


def _api_key_env(ctx: Context, spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    """The one generated key of ``N-api-key``, without spec.auth.apiKeysSecret."""
    if spec.auth.apiKeysSecret is not None:
        return []
    return [_secret_env("ITERSERVE_API_KEY", api_key_secret_name(ctx.name), "api-key")]


def quantity(value: float) -> str:
    """``value`` as a Kubernetes quantity in the API server's canonical form (``2.5`` ->
    ``2500m``), so that the live object reads back as built and :func:`apply` does not patch
    it on every pass."""
    exact = Decimal(repr(value))
    for suffix, scale in (("", 1), ("m", 10**3), ("u", 10**6)):
        scaled = exact * scale
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{suffix}"
    return f"{max(1, round(exact * 10**9))}n"


_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?")
_BINARY = {s: 1024**i for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def canonical_quantity(text: str) -> str:
    """A quantity as the API server writes it back (k8s.io/apimachinery's canonical form:
    ``1000m`` -> ``1``, ``1024Mi`` -> ``1Gi``, ``0.5`` -> ``500m``, ``1.5Gi`` -> ``1536Mi``),
    so that a pod template carrying it reads back as built and is not patched every pass.

    Raises:
        SpecError: not a non-negative quantity.
    """
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise SpecError(f"not a Kubernetes quantity: {text!r}")
    number, suffix = Decimal(match[1]), match[2] or ""
    if suffix in _BINARY and suffix:
        fmt, value = "binary", number * _BINARY[suffix]
    elif suffix[:1] in ("e", "E"):
        fmt, value = "exponent", number.scaleb(int(suffix[1:]))
    else:
        fmt, value = "decimal", number.scaleb(_DECIMAL[suffix])
    # Precision beyond nano units is rounded up, as the API server parses.
    value = (value.scaleb(9).to_integral_value(rounding=ROUND_CEILING)).scaleb(-9)
    if value == 0:
        return "0"
    if fmt == "binary" and (value < 1024 or value != value.to_integral_value()):
        fmt = "decimal"
    if fmt == "binary":
        amount, power = int(value), 0
        while amount % 1024 == 0 and power < 6:
            amount, power = amount // 1024, power + 1
        return f"{amount}{list(_BINARY)[power]}"
    # An integer mantissa with the exponent lowered to a multiple of 3.
    _, digits, exponent = value.normalize().as_tuple()
    mantissa = int("".join(map(str, digits)))
    assert isinstance(exponent, int)
    shift = exponent % 3
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    suffixes = {e: s for s, e in _DECIMAL.items()}
    if fmt == "decimal" and exponent in suffixes:
        return f"{mantissa}{suffixes[exponent]}"
    return f"{mantissa}e{exponent}" if exponent else str(mantissa)


def _field_env(env: str, field_path: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def _secret_env(env: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NON_ROOT_UID,
        "runAsGroup": NON_ROOT_UID,
        "fsGroup": NON_ROOT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _probe(path: str, port: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _resources(spec: LLMDeploymentSpec) -> dict[str, Any]:
    """Requests equal to limits, GPU and CPU pods alike: the scheduler places a pod by what
    it requests (a GPU pod needs host memory to load its weights), and with ``cpu`` and
    ``memory`` both given the pod is Guaranteed (evicted last). Only what the spec gives:
    without them the namespace's defaults apply. Never an empty map (the API server drops it,
    and the Deployment would read back drifted and be patched on every pass)."""
    r = spec.resources
    amounts: dict[str, Any] = {}
    if r.gpus:
        amounts["nvidia.com/gpu"] = str(r.gpus)  # a quantity
    if r.cpu is not None:
        amounts["cpu"] = canonical_quantity(str(r.cpu))
    if r.memory is not None:
        amounts["memory"] = canonical_quantity(str(r.memory))
    return {"limits": amounts, "requests": dict(amounts)} if amounts else {}


def server_deployment(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The server Deployment. Its pod template does not depend on the scheduler settings
    (those are pushed live), so a scheduler change never rolls it. ``spec.replicas`` is left
    out while an autoscaler owns the count."""
    model_dir, volumes, mounts, init = _model_volume(spec)
    auth_volumes, auth_mounts = _auth_volumes(ctx, spec)
    volumes = [
        *volumes,
        *auth_volumes,
        {"name": "config", "configMap": {"name": f"{ctx.name}-scheduler"}},
        # Re-read by the server when the kubelet refreshes it (an admin token rotation).
        {"name": "admin-token", "secret": {"secretName": admin_secret_name(ctx.name)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts = [
        *mounts,
        *auth_mounts,
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/var/cache/iterserve"},
    ]
    if spec.tensor_parallel_size > 1:  # NCCL's shared memory
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    env = [
        *_api_key_env(ctx, spec),
        {"name": "XDG_CACHE_HOME", "value": "/var/cache/iterserve"},
        # The KV-events topic's pod (kv@<pod>@<model>): the pod's name, not a hostname.
        _field_env(KV_EVENTS_POD_ENV, "metadata.name"),
        # An empty value is dropped by the API server (omitempty): as built, it would read
        # back different and be patched on every pass.
        *({k: v for k, v in e.items() if not (k == "value" and v == "")} for e in spec.pod.env),
    ]
    container: dict[str, Any] = {
        "name": "server",
        "image": spec.image,
        "command": ["iterserve"],
        "args": server_args(spec, model_dir),
        "ports": [
            {"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "volumeMounts": mounts,
        "startupProbe": _probe("/health", "http", STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES),
        "livenessProbe": _probe("/health", "http", 10, 3),
        "readinessProbe": _probe("/ready", "http", 2, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": _container_security(),
    }
    if resources := _resources(spec):
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": SERVER_GRACE_S + ABORT_WAIT_S + PRESTOP_SLEEP_S + 15,
        "enableServiceLinks": False,
    }
    if init is not None:
        pod_spec["initContainers"] = [init]
    p = spec.pod
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        if getattr(p, key):
            pod_spec[key] = getattr(p, key)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(SERVER_PORT),
        "prometheus.io/path": "/metrics",
        **p.annotations,
    }
    gpu = spec.resources.gpus > 0
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ctx, ctx.name, "server"),
        "spec": {
            "selector": {"matchLabels": selector(ctx.name, "server")},
            # GPUs are scarce: replace one pod at a time instead of asking for more.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}
                if gpu
                else {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": {**p.labels, **labels(ctx.name, "server")},
                    "annotations": annotations,
                },
                "spec": pod_spec,
            },
        },
    }
    if not spec.autoscaling.enabled:
        body["spec"]["replicas"] = spec.replicas
    return body


def server_service(ctx: Context) -> dict[str, Any]:
    """Headless: the router discovers the pods through its EndpointSlices. The API port only:
    the admin port is in no Service."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ctx, server_service_name(ctx.name), "server"),
        "spec": {
            "clusterIP": "None",
            "selector": selector(ctx.name, "server"),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http"}],
        },
    }


# --------------------------------------------------------------------------- router


def _router_args(ctx: Context, spec: LLMDeploymentSpec) -> list[str]:
    """``iterserve router`` arguments, proxy or endpoint picker: the same discovery, policy
    and credentials in both modes."""
    mode = ["--mode", "endpoint-picker", "--grpc-port", str(EPP_GRPC_PORT)]
    args = [
        "router",
        *(mode if picker_mode(spec) else []),
        "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT),
        "--k8s-service", server_service_name(ctx.name),
        "--namespace", ctx.namespace,
        "--k8s-port-name", "http",
        "--policy", spec.router.policy,
        "--shutdown-grace-period-s", str(ROUTER_GRACE_S),
        *_auth_args(spec),
    ]  # fmt: skip
    if spec.router.kvEvents:
        args += ["--kv-events-port", str(KV_EVENTS_PORT), "--tokenizer", _router_tokenizer(spec)[0]]
    return args


def _router_tokenizer(spec: LLMDeploymentSpec) -> tuple[str, dict[str, Any]]:
    """(the model directory, its volume) for the router's ``--tokenizer`` with kvEvents: the
    server pods' model volume (source pvc or hostPath), mounted read-only. The spec's rules
    refuse kvEvents with source image (the weights are in the server image) or uri (a
    download per router pod would cost what a server's does): no tokenizer to read there."""
    model_dir, volumes, _, _ = _model_volume(spec)
    assert spec.model.source.image is None and spec.model.source.uri is None, "the rules"
    return model_dir, volumes[0]


def router_deployment(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The router Deployment ``N-router``, or in endpointPicker mode the picker's ``N-epp``
    (the same program with ``--mode endpoint-picker``, its ext_proc port ``grpc`` besides
    ``http``, which then serves /health, /ready and /metrics only)."""
    picker = picker_mode(spec)
    name, component = (epp_name if picker else router_name)(ctx.name), front_component(spec)
    volumes, mounts = _auth_volumes(ctx, spec)
    if spec.router.kvEvents:
        volumes.append(_router_tokenizer(spec)[1])
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    ports = [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}]
    if picker:
        ports.append({"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": "epp" if picker else "router",
        "image": spec.router.image or ctx.control_image,
        "command": ["iterserve"],
        "args": _router_args(ctx, spec),
        "ports": ports,
        "volumeMounts": mounts,
        "livenessProbe": _probe("/health", "http", 10, 3),
        # The router's /ready fails while no server pod is ready. Scaled to zero, the router
        # must stay in its Service anyway: the requests it holds are what wake the server
        # pods (docs/autoscaling.md).
        "readinessProbe": _probe("/health" if spec.scales_to_zero else "/ready", "http", 2, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "securityContext": _container_security(),
    }
    # The replicas are sent the router token, not a client key. No empty env (the API server
    # drops it: the Deployment would read back drifted).
    if env := _api_key_env(ctx, spec):
        container["env"] = env
    pod_spec = {
        # One ServiceAccount in both modes: its Role is the same (EndpointSlices).
        "serviceAccountName": router_name(ctx.name),
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": ROUTER_GRACE_S + ABORT_WAIT_S + PRESTOP_SLEEP_S + 10,
        "enableServiceLinks": False,
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ROUTER_PORT),
        "prometheus.io/path": "/metrics",
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ctx, name, component),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector(ctx.name, component)},
            "template": {
                "metadata": {"labels": labels(ctx.name, component), "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def router_service(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """``N-router`` (port ``http``: where clients go), or in endpointPicker mode ``N-epp``:
    port ``grpc`` 9002 (the InferencePool's endpointPickerRef; appProtocol h2c) and ``http``
    8080 (its /metrics)."""
    ports: list[dict[str, Any]] = [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}]
    if picker_mode(spec):
        grpc = {"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": "grpc"}
        ports.insert(0, {**grpc, "appProtocol": EPP_APP_PROTOCOL})
    name = (epp_name if picker_mode(spec) else router_name)(ctx.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ctx, name, front_component(spec)),
        "spec": {"selector": selector(ctx.name, front_component(spec)), "ports": ports},
    }


def inference_pool(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The InferencePool ``N`` (Gateway API Inference Extension, ``v1``): the server pods by
    their selector labels, their ``http`` port, and the picker's Service as its
    ``endpointPickerRef``. A gateway routes an HTTPRoute's traffic for the pool to the pod the
    picker names."""
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _meta(ctx, ctx.name, "server"),
        "spec": {
            "selector": {"matchLabels": selector(ctx.name, "server")},
            "targetPorts": [{"number": SERVER_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_name(ctx.name),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": spec.router.failureMode,
            },
        },
    }


def router_rbac(ctx: Context) -> list[dict[str, Any]]:
    """ServiceAccount, Role (EndpointSlices get/list/watch, nothing else), RoleBinding."""
    name = router_name(ctx.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(ctx, name, "router")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(ctx, name, "router"),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(ctx, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]


# --------------------------------------------------------------------------- NetworkPolicies


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def operator_peer(ctx: Context) -> dict[str, Any]:
    """The operator's pods as a NetworkPolicy peer: its labels, in its namespace (any
    namespace when unknown, as for ``iterserve operator render``)."""
    namespaces: dict[str, Any] = {}
    if ctx.operator_namespace is not None:
        namespaces = {"matchLabels": {"kubernetes.io/metadata.name": ctx.operator_namespace}}
    return {
        "namespaceSelector": namespaces,
        "podSelector": {"matchLabels": dict(ctx.operator_labels)},
    }


def network_policies(ctx: Context, spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    """``N-server``: the server pods take their API port from the router's pods (the picker's
    in endpointPicker mode), the operator's (``/load``) and the namespaces of
    ``spec.networkPolicy.apiFrom`` (a Prometheus scraping ``/metrics``; the gateway's, which
    sends the requests there in endpointPicker mode), their admin port from the operator's pods
    only, their KV-events port from the router's (picker's) pods and apiFrom's namespaces (another
    prefix-aware picker subscribing). ``N-router``:
    the router pods take their port from anywhere; ``N-epp`` instead: the picker pods take
    their ports (ext_proc, metrics) from the namespaces of apiFrom. Ingress only; none when
    ``spec.networkPolicy.enabled`` is false. (The kubelet's probes come from the node, which
    NetworkPolicies do not restrict.)"""
    if not spec.networkPolicy.enabled:
        return []
    front = {"podSelector": {"matchLabels": selector(ctx.name, front_component(spec))}}
    api_peers: list[dict[str, Any]] = [front, operator_peer(ctx)]
    namespaces: list[dict[str, Any]] = []
    if spec.networkPolicy.apiFrom:
        names = list(spec.networkPolicy.apiFrom)
        match = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": names}
        namespaces.append({"namespaceSelector": {"matchExpressions": [match]}})
    ingress = [
        {"from": [*api_peers, *namespaces], "ports": [_tcp(SERVER_PORT)]},
        {"from": [operator_peer(ctx)], "ports": [_tcp(ADMIN_PORT)]},
    ]
    ingress.append({"from": [front, *namespaces], "ports": [_tcp(KV_EVENTS_PORT)]})
    server = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ctx, server_service_name(ctx.name), "server"),
        "spec": {
            "podSelector": {"matchLabels": selector(ctx.name, "server")},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
    if picker_mode(spec):
        # The rules require apiFrom here (the gateway's namespace): never an empty "from".
        front_ingress = [{"from": namespaces, "ports": [_tcp(EPP_GRPC_PORT), _tcp(ROUTER_PORT)]}]
    else:
        front_ingress = [{"ports": [_tcp(ROUTER_PORT)]}]  # no "from": any source
    component = front_component(spec)
    front_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ctx, f"{ctx.name}-{component}", component),
        "spec": {
            "podSelector": {"matchLabels": selector(ctx.name, component)},
            "policyTypes": ["Ingress"],
            "ingress": front_ingress,
        },
    }
    return [server, front_policy]


# --------------------------------------------------------------------------- PDB, autoscaler


def pod_disruption_budget(ctx: Context, component: str = "server") -> dict[str, Any]:
    """``maxUnavailable: 1``: a node drain is never blocked, and never takes two at once. The
    server pods' is ``N``, the router's (picker's) ``N-router`` (``N-epp``)."""
    name = ctx.name if component == "server" else f"{ctx.name}-{component}"
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ctx, name, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(ctx.name, component)}},
    }


def router_disruption_budget(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any] | None:
    """The router's (picker's) budget, from 2 replicas: a drain evicts one at a time, so one
    always answers. None below 2 (with one replica ``maxUnavailable: 1`` allows nothing more
    than no budget, and ``minAvailable: 1`` would block every drain)."""
    if spec.router.replicas < 2:
        return None
    return pod_disruption_budget(ctx, front_component(spec))


# The HPA's behaviour on both paths (KEDA passes it to the HPA it creates): scale up at once,
# scale down on the highest recommendation of the last 5 minutes, because a replica takes
# minutes to load and must not be given back on a dip.
SCALE_UP_WINDOW_S, SCALE_DOWN_WINDOW_S = 0, 300
# KEDA: how often it checks the triggers for activation (0 <-> 1; the HPA it creates polls the
# metrics itself every 15 s), and how long every trigger must be inactive before it scales to 0.
KEDA_POLLING_INTERVAL_S, KEDA_COOLDOWN_S = 15, 300
# Scale to zero wakes on the router's requests: their rate over WAKE_WINDOW (rate() needs two
# samples in it: 8 scrapes at a 15 s interval, 2 at 60 s, Prometheus' default) plus the
# requests it holds now (counted in WAKE_METRIC only once answered, up to the router's hold
# timeout later), clamped to 1 so that this trigger asks for exactly one replica while
# requests arrive and never scales out (the queue trigger does).
WAKE_METRIC = "iterserve_router_requests_total"
HELD_METRIC = "iterserve_router_held_requests"
WAKE_WINDOW = "2m"


def pod_regex(deployment: str) -> str:
    """The names of a Deployment's pods (``DEPLOYMENT-<replicaset hash>-<pod suffix>``), as a
    PromQL regex (anchored by PromQL): ``N`` matches the server pods, not ``N-router``'s."""
    return f"{deployment}-[a-z0-9]+-[a-z0-9]+"


def queue_query(ctx: Context) -> str:
    """KEDA's queue trigger: the waiting requests summed over the model's server pods."""
    selector_ = f'namespace="{ctx.namespace}",pod=~"{pod_regex(ctx.name)}"'
    return f"sum({QUEUE_METRIC}{{{selector_}}})"


def wake_query(ctx: Context, spec: LLMDeploymentSpec) -> str:
    """KEDA's wake trigger (scale to zero only): the router (picker) pods' request rate (every
    answer, the 503s given when a hold times out included), in requests per second, plus the
    requests they hold while no server pod is ready, clamped to 1. Either sum is 0 when its
    metric has no series (``or vector(0)``: an empty operand would empty the addition)."""
    pods = pod_regex(f"{ctx.name}-{front_component(spec)}")
    selector_ = f'namespace="{ctx.namespace}",pod=~"{pods}"'
    rate = f"sum(rate({WAKE_METRIC}{{{selector_}}}[{WAKE_WINDOW}])) or vector(0)"
    held = f"sum({HELD_METRIC}{{{selector_}}}) or vector(0)"
    return f"clamp_max(({rate}) + ({held}), 1)"


def _behavior() -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": SCALE_UP_WINDOW_S},
        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S},
    }


def autoscaler(ctx: Context, spec: LLMDeploymentSpec) -> dict[str, Any] | None:
    """The HPA (a Pods metric: waiting requests per pod, served by prometheus-adapter) or the
    KEDA ScaledObject (a Prometheus ``sum()`` over the model's pods, and with
    ``minReplicas: 0`` a second trigger on the router's request rate that wakes it); None when
    off. docs/autoscaling.md explains both."""
    a = spec.autoscaling
    if not a.enabled:
        return None
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": ctx.name}
    if a.via == "hpa":
        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(ctx, ctx.name, "server"),
            "spec": {
                "scaleTargetRef": target,
                "minReplicas": a.minReplicas,
                "maxReplicas": a.maxReplicas,
                "metrics": [
                    {
                        "type": "Pods",
                        "pods": {
                            "metric": {"name": QUEUE_METRIC},
                            "target": {
                                "type": "AverageValue",
                                "averageValue": quantity(a.targetQueueDepth),
                            },
                        },
                    }
                ],
                "behavior": _behavior(),
            },
        }
    assert a.prometheusURL is not None  # the spec's rules
    triggers = [
        {
            "type": "prometheus",
            "name": "queue",
            "metadata": {
                "serverAddress": a.prometheusURL,
                "query": queue_query(ctx),
                # Every digit, no exponent: 1234567 stays 1234567 (":g" would round it).
                "threshold": format(Decimal(repr(a.targetQueueDepth)).normalize(), "f"),
                "activationThreshold": "0",
            },
        }
    ]
    if spec.scales_to_zero:
        triggers.append(
            {
                "type": "prometheus",
                "name": "wake",
                "metadata": {
                    "serverAddress": a.prometheusURL,
                    "query": wake_query(ctx, spec),
                    # ceil(value / 1) = 1 replica for any rate in (0, 1]: never scales out.
                    "threshold": "1",
                    # Active above 0: one request in the window wakes the server pods.
                    "activationThreshold": "0",
                },
            }
        )
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(ctx, ctx.name, "server"),
        "spec": {
            "scaleTargetRef": {"name": ctx.name},
            "minReplicaCount": a.minReplicas,
            "maxReplicaCount": a.maxReplicas,
            "pollingInterval": KEDA_POLLING_INTERVAL_S,
            "cooldownPeriod": KEDA_COOLDOWN_S,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior()}},
            "triggers": triggers,
        },
    }


def build_all(ctx: Context, spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    """Every owned object in render order: ConfigMap, Services, Deployments, RBAC,
    NetworkPolicies, PDBs, autoscaler, InferencePool (Secrets are referenced, not built).

    Raises:
        SpecError: settings the server would refuse.
    """
    check_name(ctx.name, ctx.namespace)
    check_objects_fields(spec)
    deployment = server_deployment(ctx, spec)
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    check_server_args(spec, server["args"], desired_settings(spec))
    objects = [
        config_map(ctx, spec),
        server_service(ctx),
        router_service(ctx, spec),
        deployment,
        router_deployment(ctx, spec),
        *router_rbac(ctx),
        *network_policies(ctx, spec),
        pod_disruption_budget(ctx),
    ]
    if (budget := router_disruption_budget(ctx, spec)) is not None:
        objects.append(budget)
    if (scaler := autoscaler(ctx, spec)) is not None:
        objects.append(scaler)
    if picker_mode(spec):
        objects.append(inference_pool(ctx, spec))
    return objects
