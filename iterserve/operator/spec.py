"""The ``LLMDeployment`` spec (DESIGN.md, "Custom resource"), as pydantic models.

One source of truth: the CRD's OpenAPI schema is generated from these models
(:mod:`iterserve.operator.crd`), and the operator parses every resource it reconciles with
them. Field names are the resource's camelCase; defaults are the production (GPU) values of
the design's ``scheduler_config`` table. Rules across fields are checked twice: by the API
server (the CRD's CEL rules, so ``kubectl apply`` refuses them) and here (so ``iterserve
operator render`` and a cluster without CEL refuse them too). What only the server knows
(a tier set it would refuse, swap without swap space) is checked by
:func:`desired_settings` with the server's own live-settings validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from iterserve.config import DEFAULT_TIERS, SchedulerConfig
from iterserve.server.live_config import LiveConfigError, VersionedSettings, merge

GROUP, VERSION, KIND, PLURAL = "iterserve.io", "v1alpha1", "LLMDeployment", "llmdeployments"


class SpecError(ValueError):
    """A spec the schema let through but the operator cannot apply (``Ready=False``)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PvcSource(_Model):
    """Weights on a PersistentVolumeClaim, mounted read-only."""

    claimName: str = Field(min_length=1, description="the claim's name")
    path: str = Field("", description="the model directory inside the volume")


class ImageSource(_Model):
    """Weights baked into the server image."""

    path: str = Field(min_length=1, description="the model directory inside the image")


class ModelSource(_Model):
    """Where the weights are: exactly one of pvc, hostPath, image, uri."""

    pvc: PvcSource | None = None
    hostPath: str | None = Field(None, min_length=1, description="a directory on the node")
    image: ImageSource | None = None
    uri: str | None = Field(
        None,
        min_length=1,
        description="downloaded by initImage into an emptyDir before the server starts",
    )
    initImage: str | None = Field(
        None, min_length=1, description="the downloader for uri: run as `IMAGE URI DIR`"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [k for k in ("pvc", "hostPath", "image", "uri") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of pvc, hostPath, image, uri (got {given})")
        if (self.uri is None) != (self.initImage is None):
            raise ValueError("uri and initImage go together")
        return self


class ModelSpec(_Model):
    name: str = Field(min_length=1, max_length=253, description="the served model id")
    source: ModelSource


class Resources(_Model):
    gpus: int = Field(1, ge=0, le=16, description="GPUs per replica (0: CPU pods)")
    cpu: str | None = Field(None, description="CPU request and limit, e.g. '8'")
    memory: str | None = Field(None, description="memory request and limit, e.g. 64Gi")


class PodOverrides(_Model):
    """Passed through to the server pods."""

    nodeSelector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    imagePullSecrets: list[dict[str, Any]] = Field(default_factory=list)
    env: list[dict[str, Any]] = Field(default_factory=list)
    extraArgs: list[str] = Field(default_factory=list, description="appended to `iterserve serve`")
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)


class EngineSpec(_Model):
    """Engine flags (a change rolls the Deployment)."""

    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    maxModelLen: int | None = Field(None, ge=1, description="tokens; default: the model's")
    blockSize: Literal[8, 16, 32, 64, 128] = Field(16, description="tokens per KV block")
    gpuMemoryUtilization: float = Field(0.9, gt=0, le=1)
    swapSpace: float = Field(4, ge=0, le=1024, description="GiB of host memory for swapped KV")
    enablePrefixCaching: bool = True


class SchedulerSpec(_Model):
    """Live scheduler settings (pushed to running pods, no restart)."""

    maxNumSeqs: int = Field(128, ge=1, le=65536, description="most requests running at once")
    maxNumBatchedTokens: int = Field(
        2048, ge=1, le=1 << 20, description="token budget of one iteration"
    )
    chunkSize: int = Field(
        512,
        ge=0,
        le=1 << 20,
        description="most prefill tokens of one request per iteration (the engine's "
        "long_prefill_token_threshold; 0 = no cap beyond maxNumBatchedTokens)",
    )
    kvWatermark: float = Field(
        0.01, ge=0, lt=1, description="fraction of KV blocks kept free at admission"
    )
    preemptionMode: Literal["auto", "recompute", "swap"] = "auto"
    agingIntervalS: float = Field(
        5, gt=0, le=86400, description="seconds of waiting that raise a request one tier"
    )
    maxWaiting: int = Field(1024, ge=0, description="queued requests before 429")


class SlaTier(_Model):
    name: str = Field(min_length=1, max_length=63)
    priority: int = Field(ge=-1000, le=1000, description="lower is more urgent")
    ttftTargetMs: float | None = Field(None, gt=0)
    maxQueueWaitMs: float | None = Field(None, gt=0)


class RouterSpec(_Model):
    replicas: int = Field(1, ge=0, le=64)
    policy: Literal["least_kv", "round_robin", "session", "random"] = "least_kv"
    image: str | None = Field(None, description="default: the operator's control image")


class AutoscalingSpec(_Model):
    enabled: bool = False
    via: Literal["hpa", "keda"] = "hpa"
    minReplicas: int = Field(1, ge=0, le=1000)
    maxReplicas: int = Field(4, ge=1, le=1000)
    targetQueueDepth: float = Field(8, gt=0, description="waiting requests per pod")
    prometheusURL: str | None = Field(None, description="KEDA's Prometheus (required for keda)")


class LLMDeploymentSpec(_Model):
    """``spec`` of an ``LLMDeployment``."""

    model: ModelSpec
    image: str = Field(min_length=1, description="the server image")
    replicas: int = Field(1, ge=0, le=1000, description="ignored while autoscaling is enabled")
    resources: Resources = Field(default_factory=Resources)
    tensorParallelSize: int | None = Field(
        None, ge=1, le=16, description="default: resources.gpus (1 with no GPUs); divides it"
    )
    pod: PodOverrides = Field(default_factory=PodOverrides)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    slaTiers: Annotated[list[SlaTier], Field(max_length=32)] | None = Field(
        None, description="replaces the default tiers (premium 0, standard 1, best-effort 2)"
    )
    router: RouterSpec = Field(default_factory=RouterSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)

    @model_validator(mode="after")
    def _across_fields(self) -> LLMDeploymentSpec:
        errors = cross_field_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def tensor_parallel_size(self) -> int:
        if self.tensorParallelSize is not None:
            return self.tensorParallelSize
        return max(1, self.resources.gpus)


def cross_field_errors(spec: LLMDeploymentSpec) -> list[str]:
    """The CRD's CEL rules (:data:`iterserve.operator.crd.RULES`), in Python."""
    s, errors = spec.scheduler, []
    if s.maxNumBatchedTokens < s.maxNumSeqs:
        errors.append("scheduler.maxNumBatchedTokens must be >= scheduler.maxNumSeqs")
    if s.chunkSize > s.maxNumBatchedTokens:
        errors.append("scheduler.chunkSize must be <= scheduler.maxNumBatchedTokens")
    gpus, tp = spec.resources.gpus, spec.tensorParallelSize
    if tp is not None and gpus > 0 and gpus % tp:
        errors.append("tensorParallelSize must divide resources.gpus")
    if s.preemptionMode == "swap" and spec.engine.swapSpace <= 0:
        errors.append("scheduler.preemptionMode swap needs engine.swapSpace > 0")
    if spec.slaTiers is not None:
        names = [t.name for t in spec.slaTiers]
        if len(set(names)) != len(names):
            errors.append("slaTiers names must be unique")
        priorities = [t.priority for t in spec.slaTiers]
        if len(set(priorities)) != len(priorities):
            errors.append("slaTiers priorities must be unique")
        if not spec.slaTiers:
            errors.append("slaTiers, when given, must not be empty")
    a = spec.autoscaling
    if a.minReplicas > a.maxReplicas:
        errors.append("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
    if a.enabled and a.via == "keda" and not a.prometheusURL:
        errors.append("autoscaling.via keda needs autoscaling.prometheusURL")
    if a.enabled and a.via == "hpa" and a.minReplicas < 1:
        errors.append("autoscaling.minReplicas 0 (scale to zero) needs via keda")
    return errors


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
    s = spec.scheduler
    tiers = spec.slaTiers
    changes: dict[str, Any] = {
        "max_num_seqs": s.maxNumSeqs,
        "max_num_batched_tokens": s.maxNumBatchedTokens,
        "long_prefill_token_threshold": s.chunkSize,
        "kv_watermark": s.kvWatermark,
        "preemption_mode": s.preemptionMode,
        "aging_interval_s": s.agingIntervalS,
        "max_waiting": s.maxWaiting,
        "tiers": [
            {
                "name": t.name,
                "priority": t.priority,
                "max_queue_wait_ms": t.maxQueueWaitMs,
                "ttft_target_ms": t.ttftTargetMs,
            }
            for t in tiers
        ]
        if tiers is not None
        else [
            {
                "name": t.name,
                "priority": t.priority,
                "max_queue_wait_ms": t.max_queue_wait_ms,
                "ttft_target_ms": t.ttft_target_ms,
            }
            for t in DEFAULT_TIERS
        ],
    }
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
