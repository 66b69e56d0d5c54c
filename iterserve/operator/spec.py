"""The ``LLMDeployment`` spec (docs/kubernetes.md, its fields), as pydantic models.

One source of truth: the CRD's OpenAPI schema is generated from these models
(:mod:`iterserve.operator.crd`), and the operator parses every resource it reconciles with
them. Field names are the resource's camelCase; defaults are the production (GPU) values of
the scheduler settings. Rules across fields are one table (:mod:`iterserve.operator.rules`:
the server's own rules on the settings the spec sets, and the operator's), checked here (so
``iterserve operator render`` and a cluster without CEL refuse them) and by the API server
(the CRD's CEL rules, generated from the same table, so ``kubectl apply`` refuses them).
What the server alone decides (a tier set it would refuse) is checked by
:func:`desired_settings` with the server's own live-settings validation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from iterserve.config import DEFAULT_TIERS, LIVE_SCHEDULER_KEYS, SchedulerConfig
from iterserve.operator.rules import SETTING_PATHS, rule_errors, value_at
from iterserve.server.live_config import LiveConfigError, VersionedSettings, merge

GROUP, VERSION, KIND, PLURAL = "iterserve.io", "v1alpha1", "LLMDeployment", "llmdeployments"


class SpecError(ValueError):
    """A spec the schema let through but the operator cannot apply (``Ready=False``)."""


# A non-negative Kubernetes quantity (k8s.io/apimachinery's resource.Quantity without the
# sign): a decimal number with an optional binary (Ki..Ei), decimal (n, u, m, k, M..E) or
# exponent suffix.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    # An integer exponent only: the OpenAPI pattern Kubernetes publishes allows "1e1.5",
    # which its quantity parser then refuses when the pod is created.
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?[0-9]+))?$"
)


def _quantity(value: object) -> object:
    """A quantity as Kubernetes users write it (an integer or a string), as a string."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(
            f"a quantity is an integer or a string such as '500m' or '64Gi', got {value!r}"
        )
    text = str(value)
    if not re.fullmatch(QUANTITY_PATTERN, text):
        raise ValueError(
            f"not a non-negative Kubernetes quantity (such as 8, '500m' or '64Gi'): {value!r}"
        )
    return text


# int-or-string in the schema (the CRD's ``x-kubernetes-int-or-string``), a string once
# parsed, so the builders copy it into the pod's resources as it is.
Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": QUANTITY_PATTERN},
            ]
        }
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PvcSource(_Model):
    """Weights on a PersistentVolumeClaim, mounted read-only."""

    claimName: str = Field(
        min_length=1, description="The PersistentVolumeClaim's name, in the resource's namespace."
    )
    path: str = Field(
        "",
        description="The model directory inside the volume. Default: the volume's root.",
    )


class ImageSource(_Model):
    """Weights baked into the server image (spec.image): nothing is mounted."""

    path: str = Field(
        min_length=1,
        description="The model directory inside the server image, e.g. /opt/models/llama.",
    )


class ModelSource(_Model):
    """Where the weights are: exactly one of pvc, hostPath, image, uri (uri goes with
    initImage). A change rolls the server pods."""

    pvc: PvcSource | None = None
    hostPath: str | None = Field(
        None,
        min_length=1,
        description="A directory on the node holding the weights, mounted read-only (it must "
        "exist on every node the server pods can land on; see pod.nodeSelector).",
    )
    image: ImageSource | None = None
    uri: str | None = Field(
        None,
        min_length=1,
        description="Where to download the weights from, e.g. s3://bucket/llama-3-70b: "
        "initImage downloads them into an emptyDir before the server starts (as KServe's "
        "storageUri). Needs initImage.",
    )
    initImage: str | None = Field(
        None,
        min_length=1,
        description="The downloader image for uri, run as an init container with the "
        "arguments `URI DIR`. Given with uri only.",
    )


class ModelSpec(_Model):
    """The model to serve: its id and where its weights are. A change rolls the server
    pods."""

    name: str = Field(
        min_length=1,
        max_length=253,
        description="The served model id: the `model` clients send to the OpenAI-compatible "
        "API (the server's --served-model-name).",
    )
    source: ModelSource


class Resources(_Model):
    """Compute resources of each server pod (one model replica); CPU and memory requests
    equal their limits. A change rolls the server pods."""

    gpus: int = Field(
        1,
        ge=0,
        le=16,
        description="GPUs (nvidia.com/gpu limit) per server pod, 0 to 16. 0 runs CPU pods "
        "(demos, CPU clusters). Default 1.",
    )
    cpu: Quantity | None = Field(
        None,
        description="CPU request and limit of each server pod, a Kubernetes quantity in "
        'cores: an integer (8) or a string ("8", "500m"). Default: not set (the '
        "namespace's defaults apply).",
    )
    memory: Quantity | None = Field(
        None,
        description="Memory request and limit of each server pod, a Kubernetes quantity in "
        "bytes: 64Gi, 512Mi, or a plain integer of bytes. Default: not set (the namespace's "
        "defaults apply).",
    )


class PodOverrides(_Model):
    """Passed through to the server pods (not the router's). A change rolls the server
    pods."""

    nodeSelector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the server pods must run on (the pod's nodeSelector), e.g. "
        "a GPU product label. Default: none.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Tolerations of the server pods, as in a pod spec (e.g. for tainted GPU "
        "nodes). Default: none.",
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Affinity of the server pods, as in a pod spec. Default: none.",
    )
    imagePullSecrets: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Secrets to pull the server (and initImage) images with, as in a pod "
        "spec: [{name: SECRET}]. Default: none.",
    )
    env: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra environment variables of the server container, as in a container "
        "spec ({name, value} or {name, valueFrom}), after the operator's own. Default: none.",
    )
    extraArgs: list[str] = Field(
        default_factory=list,
        description="Arguments appended to `iterserve serve`, after those the spec sets. "
        "Default: none.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Annotations of the server pods, added over the operator's prometheus.io "
        "scrape annotations (a key given here wins). Default: none.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the server pods, added to the operator's own (the operator's "
        "selector labels win). Default: none.",
    )


class EngineSpec(_Model):
    """Engine flags of `iterserve serve`, fixed for a pod's life: a change rolls the server
    pods."""

    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto",
        description="The dtype of weights and activations: auto (bfloat16), float16, "
        "bfloat16 or float32. Default auto.",
    )
    maxModelLen: int | None = Field(
        None,
        ge=1,
        description="Longest sequence (prompt plus output) in tokens. Default: the model's "
        "maximum context length.",
    )
    blockSize: Literal[8, 16, 32, 64, 128] = Field(
        16, description="Tokens per KV-cache block: 8, 16, 32, 64 or 128. Default 16."
    )
    gpuMemoryUtilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory the engine may use (weights, activations "
        "and the KV cache), in (0, 1]. Ignored by CPU pods. Default 0.9.",
    )
    swapSpace: float = Field(
        4,
        ge=0,
        le=1024,
        description="GiB of host memory per server pod for the KV blocks of preempted "
        "requests (scheduler.preemptionMode swap or auto); 0 = no swapping. Counts against "
        "resources.memory. Default 4.",
    )
    enablePrefixCaching: bool = Field(
        True,
        description="Reuse the KV cache of a prompt prefix already computed (shared system "
        "prompts, multi-turn chats). Default true.",
    )
    quantization: Literal["none", "int8", "q4"] = Field(
        "none",
        description="Linear layers of CPU pods: none (bfloat16), int8 (int8 weights per "
        "channel and activations per token) or q4 (the model file's own Q4_1 weights: the "
        "model source holds one .gguf file). Each batch size runs on the kernel measured "
        "fastest at the pod's start. CPU pods only (resources.gpus 0); needs dtype auto or "
        "bfloat16. Default none.",
    )
    kvCacheDtype: Literal["auto", "int8"] = Field(
        "auto",
        description="KV cache of CPU pods: auto (the serving dtype) or int8 (each cached key "
        "and value row as int8 with its scale: about half the bytes, so decode attention "
        "reads less and the same memory holds 1.9x the tokens, at a small cost in quality, "
        "docs/engine.md). int8 needs CPU pods (resources.gpus 0). Default auto.",
    )


class SchedulerSpec(_Model):
    """Live scheduler settings of every server pod: a change is pushed to the ready pods
    with PUT /admin/scheduler_config (no restart; all at once, or canary pods first:
    spec.rollout) and written to the scheduler ConfigMap that new pods start from.
    status.schedulerConfigVersion and the SchedulerConfigApplied condition follow the push.
    Defaults: the production (GPU) values."""

    maxNumSeqs: int = Field(
        128,
        ge=1,
        le=65536,
        description="Most requests running at once in a pod (the batch's sequences). Default 128.",
    )
    maxNumBatchedTokens: int = Field(
        2048,
        ge=1,
        le=1 << 20,
        description="Token budget of one engine iteration in a pod (prefill and decode "
        "tokens); at least maxNumSeqs. Default 2048.",
    )
    chunkSize: int = Field(
        512,
        ge=0,
        le=1 << 20,
        description="Most prefill tokens of one request per iteration (the engine's "
        "long_prefill_token_threshold; 0 = no cap beyond maxNumBatchedTokens); at most "
        "maxNumBatchedTokens. Default 512.",
    )
    kvWatermark: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Fraction of KV blocks kept free when admitting a request (room for the "
        "running ones to grow), in [0, 1). Default 0.01.",
    )
    preemptionMode: Literal["auto", "recompute", "swap"] = Field(
        "auto",
        description="How a request preempted for KV space gives back its blocks: recompute "
        "(dropped, prefilled again on resume), swap (copied to host memory and back; needs "
        "engine.swapSpace > 0) or auto (swap when copying is cheaper than recomputing, as "
        "measured at start-up). Default auto.",
    )
    agingIntervalS: float = Field(
        5,
        gt=0,
        le=86400,
        description="Seconds of waiting that raise a queued request one priority step (so "
        "low tiers are not starved). Default 5.",
    )
    priorityPreemptionMargin: int = Field(
        1,
        ge=0,
        le=2000,
        description="Preempt running requests for a waiting one that finds every seat or KV "
        "block taken, when it is at least this many priority steps more urgent than they "
        "are (after aging); 0 = off. Default 1 (a higher tier preempts a lower one).",
    )
    maxWaiting: int = Field(
        1024,
        ge=0,
        description="Requests queued in a pod (accepted, no first token yet) before it "
        "answers new ones with 429. Default 1024.",
    )
    maxWaitingPerTenant: int | None = Field(
        None,
        ge=1,
        description="Requests one tenant (the X-Tenant-Id header, else the OpenAI user "
        "field) may have queued in a pod before its new ones get 429 tenant_queue_full, so "
        "one noisy tenant cannot fill the queue in front of the others; requests without a "
        "tenant are not capped; at most maxWaiting. Default null: no cap.",
    )


class SlaTier(_Model):
    """One SLA tier: a request's integer priority maps to the tier with the largest
    priority at or below it (the most urgent tier if none)."""

    name: str = Field(
        min_length=1,
        max_length=63,
        description="The tier's name, as metrics and logs label its requests; unique.",
    )
    priority: int = Field(
        ge=-1000,
        le=1000,
        description="The tier's priority, -1000 to 1000; lower is more urgent; unique.",
    )
    ttftTargetMs: float | None = Field(
        None,
        gt=0,
        description="Time-to-first-token target of the tier's requests, in milliseconds. "
        "Default: none.",
    )
    maxQueueWaitMs: float | None = Field(
        None,
        gt=0,
        description="Longest expected queue wait, in milliseconds, at which the tier still "
        "admits a request; above it the request is refused with 429 (queue_wait). Default: "
        "no limit.",
    )


class RolloutSpec(_Model):
    """How a change of spec.scheduler or spec.slaTiers reaches the running pods (no
    restart): all at once, or first to canary pods that bake under live traffic while a
    deploy gate compares their latency with the pods still on the old settings; the rest
    get the change when the gate holds, the canaries are rolled back when it does not
    (status.rollout, the Rollout condition and an Event say why)."""

    strategy: Literal["all", "canary"] = Field(
        "all",
        description="all: every ready pod gets a settings change at once; canary: first "
        "canaryPods pods, promoted after bakeSeconds within the gate. Default all.",
    )
    canaryPods: int = Field(
        1,
        ge=1,
        le=1000,
        description="Ready pods that get the change first (the first by name), 1 to 1000; at "
        "least one pod always stays on the old settings as the baseline. Default 1.",
    )
    bakeSeconds: int = Field(
        60,
        ge=1,
        le=86400,
        description="How long the canaries run the change before the gate decides, in whole "
        "seconds, 1 to 86400 (a day). A change beyond the gate is rolled back as soon as "
        "minRequests show it (with fewer requests the bake goes on). Default 60.",
    )
    maxTtftP99RegressionPct: float = Field(
        20,
        ge=0,
        le=10000,
        description="Most the canaries' p99 time to first token may exceed the baseline's "
        "over the bake, in percent of the baseline's (20: up to 1.2 times), 0 to 10000. "
        "Default 20.",
    )
    maxTpotP50RegressionPct: float = Field(
        15,
        ge=0,
        le=10000,
        description="Most the canaries' median time per output token may exceed the "
        "baseline's over the bake, in percent of the baseline's (15: up to 1.15 times), 0 to "
        "10000. Default 15.",
    )
    minRequests: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="Requests each group (canaries, baseline) must have served in the bake "
        "window before the gate decides; with fewer when bakeSeconds ends, the bake goes on "
        "(Rollout condition: WaitingForTraffic). Default 100: below it a p99 is the "
        "slowest request, and one late first token would roll a harmless change back.",
    )


class RouterSpec(_Model):
    """What picks a server pod for each request: the router in front of the server pods (mode
    proxy: its Service's URL is status.routerURL), or an endpoint picker behind the cluster's
    Gateway API gateway (mode endpointPicker: an InferencePool N and the picker N-epp that
    the gateway asks over Envoy's ext_proc). A change rolls the router pods only (the picker's
    in endpointPicker mode), not the server pods (they always publish their KV-cache
    events)."""

    mode: Literal["proxy", "endpointPicker"] = Field(
        "proxy",
        description="proxy: the router Deployment and Service N-router, which clients call "
        "(status.routerURL); endpointPicker: an InferencePool N (inference.networking.k8s.io/v1, "
        "its CRD installed from the Gateway API Inference Extension) selecting the server pods, "
        "and the picker Deployment and Service N-epp (gRPC port 9002) it names, for a gateway "
        "that an HTTPRoute of yours attaches to the pool (docs/kubernetes.md). Switching "
        "deletes the other mode's objects. Default proxy.",
    )
    replicas: int = Field(
        2,
        ge=0,
        le=64,
        description="Router (or picker) pods, 0 to 64; at least 1 with scale to zero "
        "(autoscaling minReplicas 0). From 2, a PodDisruptionBudget (N-router or N-epp, "
        "maxUnavailable 1) keeps one running through a node drain. Default 2.",
    )
    policy: Literal["least_kv", "round_robin", "session", "random"] = Field(
        "least_kv",
        description="How the router picks a server pod: least_kv (lowest KV-cache use and "
        "queue, with prefix affinity), round_robin, session (sticky per x-session-id header) "
        "or random. Default least_kv.",
    )
    failureMode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="endpointPicker mode: what the gateway does when the picker does not "
        "answer (the InferencePool's endpointPickerRef.failureMode): FailClose refuses the "
        "request, FailOpen sends it to a pod of the gateway's choosing. Default FailClose.",
    )
    kvEvents: bool = Field(
        False,
        description="Precise prefix routing: the router (or picker) subscribes to the server "
        "pods' KV-cache events (ZMQ, port 5557, vLLM's format; the servers always publish them) "
        "and sends a prompt where its blocks are cached. The router reads the model's "
        "tokenizer from the model's volume, mounted read-only: needs model.source pvc or "
        "hostPath. A change rolls the router pods only. Default false.",
    )
    image: str | None = Field(
        None, description="The router image. Default: the operator's configured control image."
    )


class AuthSpec(_Model):
    """Who may call the model: API keys, each of a tenant and the SLA tiers it may use."""

    apiKeysSecret: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="A Secret in the resource's namespace whose key keys.yaml lists the API "
        "keys: a YAML list of {key, tenant, tiers, default_tier} (docs/router.md). Mounted "
        "into the router and server pods and re-read when it changes (no restart): the "
        "router takes only these keys, sets each request's tenant from its key and refuses "
        "(403) a tier the key may not use; the servers trust tenant and tier headers only "
        "from the router. Default: none, one generated key in the Secret NAME-api-key and "
        "tenants as clients name them.",
    )


class AutoscalingSpec(_Model):
    """Scaling the server pods on their queue depth with a HorizontalPodAutoscaler or a KEDA
    ScaledObject that targets the server Deployment. A change updates the autoscaler object
    (and hands spec.replicas to it or back); it restarts no pod."""

    enabled: bool = Field(
        False,
        description="Create the autoscaler. While enabled, spec.replicas is ignored: the "
        "autoscaler owns the server pod count. Default false.",
    )
    via: Literal["hpa", "keda"] = Field(
        "hpa",
        description="hpa: a HorizontalPodAutoscaler on the pods' waiting-requests metric "
        "(needs prometheus-adapter serving it); keda: a KEDA ScaledObject querying "
        "prometheusURL (allows minReplicas 0). Default hpa.",
    )
    minReplicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Fewest server pods, 0 to 1000, at most maxReplicas. 0 (scale to zero) "
        "needs via keda and router.replicas >= 1: the router keeps running, answers 503 with "
        "Retry-After while no server pod is ready, and its request rate wakes the pods (the "
        "first requests fail until a pod has loaded the model). Default 1.",
    )
    maxReplicas: int = Field(
        4, ge=1, le=1000, description="Most server pods, 1 to 1000. Default 4."
    )
    targetQueueDepth: float = Field(
        8,
        gt=0,
        le=1_000_000,
        description="Waiting requests per server pod the autoscaler aims at, above 0, at most "
        "1000000: the HPA's AverageValue target of the pods' iterserve_num_requests_waiting, "
        "KEDA's threshold for their sum. Default 8.",
    )
    prometheusURL: str | None = Field(
        None,
        description="The Prometheus server KEDA queries, e.g. http://prometheus.monitoring:9090; "
        "required with via keda, unused by hpa.",
    )


# A namespace's name (a DNS-1123 label).
NAMESPACE_NAME = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
]


class NetworkPolicySpec(_Model):
    """NetworkPolicies the operator creates (N-server, N-router): the server pods take their
    API port (8000) from the router's pods, the operator's and the namespaces of apiFrom, their
    admin port (8001) from the operator's pods only; the router pods take their port (8080)
    from anywhere. They are enforced only where the cluster's network plugin implements
    NetworkPolicies. A change updates them; it restarts no pod."""

    enabled: bool = Field(
        True, description="Create the NetworkPolicies; false deletes them. Default true."
    )
    apiFrom: Annotated[list[NAMESPACE_NAME], Field(max_length=64)] = Field(
        default_factory=list,
        description="Namespaces (by name) whose pods may call the server pods' API port "
        "directly, besides the router: the Prometheus that scrapes their /metrics (e.g. "
        "monitoring). At most 64. Default: none.",
    )


class LLMDeploymentSpec(_Model):
    """A served model: server pods (a Deployment, one model replica each), the router in
    front of them and an optional autoscaler. spec.scheduler and spec.slaTiers are pushed
    live to the running pods (no restart); a change to model, image, resources,
    tensorParallelSize, pod or engine rolls the server pods (one at a time on GPUs);
    router changes roll the router pods only; replicas and autoscaling change how many
    server pods run, not the pods."""

    model: ModelSpec
    image: str = Field(
        min_length=1,
        description="The server image (runs `iterserve serve`). A change rolls the server pods.",
    )
    replicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Server pods (model replicas), 0 to 1000, also set by `kubectl scale`; "
        "ignored while autoscaling is enabled. A change scales without restarting pods. "
        "Default 1.",
    )
    resources: Resources = Field(default_factory=Resources)
    tensorParallelSize: int | None = Field(
        None,
        ge=1,
        le=16,
        description="GPUs one model replica is sharded across (the server's "
        "--tensor-parallel-size); must divide resources.gpus. Above 1 the pods get a "
        "memory-backed /dev/shm for NCCL. Default: resources.gpus (1 with no GPUs). A change "
        "rolls the server pods.",
    )
    pod: PodOverrides = Field(default_factory=PodOverrides)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    slaTiers: Annotated[list[SlaTier], Field(max_length=32)] | None = Field(
        None,
        description="The SLA tiers, 1 to 32 with unique names and priorities; pushed live "
        "like spec.scheduler (no restart). When given they replace the default tiers. "
        "Default: premium (priority 0), standard (1), best-effort (2).",
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    networkPolicy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)

    @model_validator(mode="after")
    def _across_fields(self) -> LLMDeploymentSpec:
        errors = rule_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def scales_to_zero(self) -> bool:
        """Autoscaling with KEDA down to no server pod (``minReplicas: 0``): woken by the
        router's request rate, so the router keeps running."""
        a = self.autoscaling
        return a.enabled and a.via == "keda" and a.minReplicas == 0

    @property
    def tensor_parallel_size(self) -> int:
        if self.tensorParallelSize is not None:
            return self.tensorParallelSize
        return max(1, self.resources.gpus)


def parse_spec(spec: Any) -> LLMDeploymentSpec:
    """The spec of a resource (a mapping, as the API returns it).

    Raises:
        SpecError: invalid, with every reason.
    """
    try:
        return LLMDeploymentSpec.model_validate(spec)
    except ValidationError as e:
        reasons = []
        for error in e.errors():
            where = ".".join(str(part) for part in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            reasons.append(f"spec.{where}: {message}" if where else message)
        raise SpecError("; ".join(reasons)) from e


def desired_settings(spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The live scheduler settings the spec asks for, as the server's keys
    (``GET /admin/scheduler_config`` without version and hash): every key, the defaults
    filled in, so a pod converges whatever was pushed to it by hand.

    Raises:
        SpecError: the server would refuse them (checked by the server's own merge).
    """
    changes: dict[str, Any] = {
        key: value_at(spec, tuple(SETTING_PATHS[key].split(".")))
        for key in LIVE_SCHEDULER_KEYS
        if key != "tiers"
    }
    tiers = spec.slaTiers
    changes["tiers"] = (
        [
            {
                "name": t.name,
                "priority": t.priority,
                "max_queue_wait_ms": t.maxQueueWaitMs,
                "ttft_target_ms": t.ttftTargetMs,
            }
            for t in tiers
        ]
        if tiers is not None
        else [dataclasses.asdict(t) for t in DEFAULT_TIERS]
    )
    try:
        merged = merge(
            VersionedSettings(SchedulerConfig(), 0),
            changes,
            swap_space=spec.engine.swapSpace,
            max_model_len=spec.engine.maxModelLen or 0,
        )
    except LiveConfigError as e:
        raise SpecError(f"the server would refuse these settings: {e}") from e
    view = (merged or VersionedSettings(SchedulerConfig(), 0)).view()
    view.pop("config_version")
    view.pop("config_hash")
    return view


def settings_hash_of(settings: dict[str, Any]) -> str:
    """The ``config_hash`` a pod reports once it runs ``settings`` (the server's hash)."""
    from iterserve.config import parse_tiers
    from iterserve.server.live_config import settings_hash

    values = {**settings, "tiers": parse_tiers(settings["tiers"])}
    return settings_hash(SchedulerConfig(**values))
