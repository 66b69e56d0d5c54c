"""One reconciliation of an ``LLMDeployment``: owned objects applied, live settings synced to
every ready pod, the status computed. The kopf handlers (:mod:`iterserve.operator.handlers`)
call :func:`reconcile` on create, update, resume and a timer; it is idempotent.

Versions (docs/kubernetes.md, "A live scheduler change"): the settings' version is the resource's
``metadata.generation`` at the last change of ``spec.scheduler`` or ``spec.slaTiers`` (detected by
the settings' hash kept in ``status.schedulerConfigHash``); a pod counts as applied when its
``/load`` ``config_hash`` equals the desired hash, whatever its version says.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubernetes.aio.client.exceptions import ApiException

from iterserve.operator.admin_token import new_token, parse_tokens, rotate_if_asked
from iterserve.operator.builders import (
    CONFIG_FILE,
    DEFAULT_OPERATOR_LABELS,
    INFERENCE_POOL_API,
    Context,
    admin_secret_name,
    api_key_secret_name,
    build_all,
    labels,
    picker_mode,
    router_token_secret_name,
    router_url,
    selector,
    settings_file,
)
from iterserve.operator.cli_args import DEFAULT_CONTROL_IMAGE
from iterserve.operator.kube import Kube, apply
from iterserve.operator.push import PodResult, ready_targets, sync_pods
from iterserve.operator.rollout import Push, Settings, Step, plan, replacing, scrape_pods
from iterserve.operator.spec import (
    LLMDeploymentSpec,
    SpecError,
    desired_settings,
    parse_spec,
    settings_hash_of,
)

# Owned objects a spec may stop asking for (apiVersion, kind, name suffix): deleted then (the
# others always exist). The router's objects and the picker's go when spec.router.mode
# switches to the other; their ServiceAccount, Role and RoleBinding (N-router) serve both.
_OPTIONAL = (
    ("autoscaling/v2", "HorizontalPodAutoscaler", ""),
    ("keda.sh/v1alpha1", "ScaledObject", ""),
    ("networking.k8s.io/v1", "NetworkPolicy", "-server"),
    ("networking.k8s.io/v1", "NetworkPolicy", "-router"),
    ("networking.k8s.io/v1", "NetworkPolicy", "-epp"),
    ("apps/v1", "Deployment", "-router"),
    ("v1", "Service", "-router"),
    ("policy/v1", "PodDisruptionBudget", "-router"),
    ("apps/v1", "Deployment", "-epp"),
    ("v1", "Service", "-epp"),
    ("policy/v1", "PodDisruptionBudget", "-epp"),
    (INFERENCE_POOL_API, "InferencePool", ""),
)
# What endpointPicker mode says while the API server does not serve InferencePools.
NO_POOL_API = (
    f"the API server does not serve InferencePools ({INFERENCE_POOL_API}): install the Gateway "
    'API Inference Extension\'s CRDs (docs/kubernetes.md, "Endpoint picker mode"); the picker '
    "runs, but no gateway can route to the pool until then"
)


@dataclass(frozen=True)
class OperatorSettings:
    """``iterserve operator run`` flags the handlers need."""

    control_image: str = DEFAULT_CONTROL_IMAGE
    push_timeout_s: float = 5.0
    namespaces: tuple[str, ...] = ()  # --namespace (empty: cluster-wide)
    # Where the operator's own pods run and their labels (--operator-namespace,
    # --operator-label): the NetworkPolicies' peers of the admin port.
    operator_namespace: str | None = None
    operator_labels: tuple[tuple[str, str], ...] = DEFAULT_OPERATOR_LABELS


@dataclass
class Outcome:
    """What a reconciliation found: the status to write and the events to post
    (``(type, reason, message)``, type ``Normal`` or ``Warning``)."""

    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    push_s: float | None = None  # seconds the pushes took, None when no pod was pushed
    num_pods_behind: int = 0  # ready pods not running the spec's settings
    rollout_outcome: str | None = None  # a rollout that ended: promoted/rolled_back/unchecked


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def adopt(obj: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` owned by the resource (kopf's owner reference: garbage collection deletes it
    with the resource)."""
    references = obj.setdefault("metadata", {}).setdefault("ownerReferences", [])
    reference = owner_reference(body)
    if all(r.get("uid") != reference["uid"] for r in references):
        references.append(reference)
    return obj


async def ensure_secrets(kube: Kube, ctx: Context, body: Mapping[str, Any]) -> tuple[str, ...]:
    """The API-key, router-token and admin-token Secrets, created with random values when
    absent (owned by the resource); the admin tokens, the current one first
    (:mod:`.admin_token`)."""
    for name, key in (
        (api_key_secret_name(ctx.name), "api-key"),
        (router_token_secret_name(ctx.name), "token"),
        (admin_secret_name(ctx.name), "token"),
    ):
        live = await kube.get("v1", "Secret", ctx.namespace, name)
        if live is None or not (live.get("data") or {}).get(key):
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": name,
                    "namespace": ctx.namespace,
                    "labels": labels(ctx.name, "server"),
                },
                "type": "Opaque",
                "data": {key: base64.b64encode(new_token().encode()).decode()},
            }
            if live is None:
                try:
                    await kube.create(adopt(secret, body))
                except ApiException as e:
                    if e.status != 409:  # 409: created meanwhile by another pass
                        raise
            else:  # a Secret of the user's without the key: the key added, its type kept
                await kube.patch({k: v for k, v in secret.items() if k != "type"})
            live = await kube.get("v1", "Secret", ctx.namespace, name)
            assert live is not None, f"Secret {name} vanished"
    assert live is not None
    return parse_tokens(live)


def _api_message(e: ApiException) -> str:
    """The ``message`` of the API server's Status body, else its reason."""
    try:
        message = json.loads(e.reason or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or e.reason)


def condition(
    previous: list[dict[str, Any]],
    kind: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
) -> dict[str, Any]:
    """A condition in Kubernetes' conventions; ``lastTransitionTime`` kept while the status
    does not change."""
    before = next((c for c in previous if c.get("type") == kind), None)
    if before is not None and before.get("status") == status:
        since = before.get("lastTransitionTime")
    else:
        since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def invalid_status(body: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """The status of a spec that cannot be applied: ``Ready=False``, reason ``InvalidSpec``."""
    meta, status = body["metadata"], body.get("status") or {}
    generation = int(meta.get("generation") or 1)
    previous = status.get("conditions") or []
    return {
        "observedGeneration": generation,
        "conditions": [
            condition(previous, "Ready", "False", "InvalidSpec", reason, generation),
            condition(previous, "Progressing", "False", "InvalidSpec", reason, generation),
            condition(
                previous, "SchedulerConfigApplied", "False", "InvalidSpec", reason, generation
            ),
        ],
    }


async def _admin_tokens(kube: Kube, ctx: Context, body: Mapping[str, Any]) -> tuple[str, ...]:
    """:func:`ensure_secrets`, a 403 on Secrets being the chart's values' fault (SpecError)."""
    try:
        return await ensure_secrets(kube, ctx, body)
    except ApiException as e:
        if e.status != 403:
            raise
        # The chart grants Secrets per namespace (docs/kubernetes.md, "RBAC"): say which value.
        raise SpecError(
            f"the operator may not use Secrets in namespace {ctx.namespace}: add it to the "
            "chart's value secretNamespaces (or watchNamespaces) and upgrade the release"
        ) from e


async def _delete_unwanted(
    kube: Kube, ctx: Context, built: list[dict[str, Any]], uid: str
) -> list[tuple[str, str, str]]:
    """Delete the optional objects (autoscalers, NetworkPolicies) the spec no longer asks for
    and that the resource owns; their Events.

    An autoscaler the spec no longer asks for goes first, before another takes over: KEDA's
    admission webhook refuses a ScaledObject on a Deployment an HPA already scales, and two
    autoscalers on one Deployment would fight over its replicas."""
    events = []
    for api_version, kind, suffix in _OPTIONAL:
        name = ctx.name + suffix
        if not any((o["kind"], o["metadata"]["name"]) == (kind, name) for o in built):
            live = await kube.get(api_version, kind, ctx.namespace, name)
            owners = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
            if any(o.get("uid") == uid for o in owners):
                await kube.delete(api_version, kind, ctx.namespace, name)
                events.append(("Normal", "Deleted", f"{kind} {name}"))
    return events


async def reconcile(kube: Kube, body: Mapping[str, Any], settings: OperatorSettings) -> Outcome:
    """Apply the resource once (see the module docstring).

    Raises:
        SpecError: the spec cannot be applied (nothing was, or the API server refused an
            object as invalid), or the admin-token Secret holds no usable token.
        kubernetes ApiException: the API failed (retry).
    """
    meta, status = body["metadata"], body.get("status") or {}
    spec = parse_spec(body.get("spec"))
    desired = desired_settings(spec)
    desired_hash = settings_hash_of(desired)
    generation = int(meta.get("generation") or 1)
    version = status.get("schedulerConfigVersion")
    if status.get("schedulerConfigHash") != desired_hash or not version:
        version = generation
    ctx = Context(
        meta["name"],
        meta["namespace"],
        generation,
        settings.control_image,
        version,
        settings.operator_namespace,
        settings.operator_labels,
    )
    built = build_all(ctx, spec)  # before anything is applied: an invalid spec applies nothing
    admin_tokens = await _admin_tokens(kube, ctx, body)
    events = await _delete_unwanted(kube, ctx, built, meta["uid"])
    await _start_from_zero(kube, ctx, spec, built)
    # The Deployment's counts are read before the pods: a pod that turns ready between the
    # two reads is then in the pod list (and pushed to) before any status counts it ready,
    # never "1 ready replica" beside "no ready pod to apply the settings to".
    counted = await kube.get("apps/v1", "Deployment", ctx.namespace, ctx.name) or {}
    pods = await kube.list("Pod", ctx.namespace, selector(ctx.name, "server"))
    step = await plan(
        spec.rollout,
        Settings(desired, desired_hash, version),
        await _config_map_settings(kube, ctx),
        status.get("rollout") or {},
        ready_targets(pods),
        scrape_pods(settings.push_timeout_s),
        time.time(),
        restart_counts(pods),
    )
    (config,) = [o for o in built if o["kind"] == "ConfigMap"]
    config["data"][CONFIG_FILE] = settings_file(step.config_map.values, step.config_map.version)
    applied_events, pool_missing = await _apply_all(kube, built, body)
    events += applied_events
    targets = ready_targets(pods)
    admin_tokens, rotation, rotation_events = await rotate_if_asked(
        kube, ctx, body, admin_tokens, targets, settings.push_timeout_s
    )
    events += rotation_events
    started = time.monotonic()
    pushed = await _push(step.pushes, admin_tokens, settings.push_timeout_s)
    push_s = time.monotonic() - started
    results = [r for _, r in pushed]
    for push, r in pushed:
        if r.pushed and r.applied:
            message = f"pod {r.name}: settings version {push.settings.version}"
            events.append(("Normal", "ConfigPushed", message))
        elif r.error is not None:
            events.append(("Warning", "ConfigPushFailed", f"pod {r.name}: {r.error}"))
    deployment = await kube.get("apps/v1", "Deployment", ctx.namespace, ctx.name) or {}
    deployment = {**deployment, "status": counted.get("status") or {}}
    new_status = _status(ctx, spec.replicas, status, deployment, results, desired_hash, pods, step)
    new_status.update(_front_status(ctx, spec, new_status, status, pool_missing))
    if pool_missing and _ready_reason(status) != "InferencePoolMissing":
        events.append(("Warning", "InferencePoolMissing", NO_POOL_API))
    behind = sum(1 for push, r in pushed if push.settings.hash != desired_hash or not r.applied)
    return Outcome(
        {**new_status, **rotation},
        events + step.events,
        push_s if any(r.pushed for r in results) else None,
        behind,
        step.outcome,
    )


async def _apply_all(
    kube: Kube, built: list[dict[str, Any]], body: Mapping[str, Any]
) -> tuple[list[tuple[str, str, str]], bool]:
    """Apply every built object (owned by the resource); the Events of those patched, and
    whether the InferencePool could not be applied because the API server does not serve
    its kind (its CRD not installed: the rest is applied, the status says so).

    Raises:
        SpecError: the API server refused an object as invalid.
        kubernetes ApiException: the API failed (retry).
    """
    events, pool_missing = [], False
    for obj in sorted(built, key=_apply_rank):
        try:
            done = await apply(kube, adopt(obj, body))
        except ApiException as e:
            if e.status == 404 and obj["kind"] == "InferencePool":
                pool_missing = True
                continue
            if e.status != 422:
                raise
            # Invalid: what the operator's checks let through (a pass-through field's depths,
            # an older cluster's rules) is the spec's fault, not a reason to retry it.
            raise SpecError(
                f"the API server refused {obj['kind']} {obj['metadata']['name']}: {_api_message(e)}"
            ) from e
        if done == "patched":
            events.append(("Normal", "Updated", f"{obj['kind']} {obj['metadata']['name']}"))
    return events, pool_missing


def _ready_reason(status: Mapping[str, Any]) -> str | None:
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return ready[0].get("reason") if ready else None


def _front_status(
    ctx: Context,
    spec: LLMDeploymentSpec,
    status: Mapping[str, Any],
    previous: Mapping[str, Any],
    pool_missing: bool,
) -> dict[str, Any]:
    """What the status says of the pods in front of the servers: ``routerURL`` (the router
    Service's URL) in proxy mode; in endpointPicker mode no ``routerURL`` (clients call the
    gateway, which the operator does not know) and ``inferencePool``, the pool's name an
    HTTPRoute's backendRef names; ``Ready=False`` (``InferencePoolMissing``) while the
    API server does not serve InferencePools. ``status`` is the new status, ``previous`` the
    resource's (null: removed by the merge patch)."""
    if not picker_mode(spec):
        return {"routerURL": router_url(ctx), "inferencePool": None}
    out: dict[str, Any] = {"routerURL": None, "inferencePool": ctx.name}
    if pool_missing:
        conditions = list(status["conditions"])
        (i,) = [i for i, c in enumerate(conditions) if c["type"] == "Ready"]
        conditions[i] = condition(
            previous.get("conditions") or [],
            "Ready",
            "False",
            "InferencePoolMissing",
            NO_POOL_API,
            ctx.generation,
        )
        out["conditions"] = conditions
    return out


async def _push(
    pushes: list[Push], admin_tokens: Sequence[str], timeout_s: float
) -> list[tuple[Push, PodResult]]:
    """Each push's settings to its pods, all at once; each pod's result with its push."""
    answers = await asyncio.gather(
        *(
            sync_pods(p.pods, p.settings.values, p.settings.hash, p.settings.version,
                      admin_tokens, timeout_s)
            for p in pushes
        )
    )  # fmt: skip
    return [(p, r) for p, results in zip(pushes, answers, strict=True) for r in results]


async def _config_map_settings(kube: Kube, ctx: Context) -> Settings | None:
    """The settings the live ConfigMap holds (what a new pod starts on), None when there is
    none or it holds something else (written by hand: the spec's settings replace it)."""
    live = await kube.get("v1", "ConfigMap", ctx.namespace, f"{ctx.name}-scheduler")
    try:
        values = yaml.safe_load(((live or {}).get("data") or {})[CONFIG_FILE])
        version = values.pop("config_version")
        if isinstance(version, bool) or not isinstance(version, int):
            return None
        return Settings(values, settings_hash_of(values), version)
    except Exception:  # missing, not YAML, not the settings: nothing to roll from
        return None


# Applied before the rest: the router Deployment's pods need their ServiceAccount (else the
# ReplicaSet controller reports FailedCreate once) and its permissions. Render's order
# (ConfigMap, Services, Deployments, RBAC, PDB, autoscaler) is kept otherwise; sorted() is stable.
_FIRST = ("ServiceAccount", "Role", "RoleBinding")


def _apply_rank(obj: Mapping[str, Any]) -> int:
    return 0 if obj["kind"] in _FIRST else 1


async def _start_from_zero(
    kube: Kube, ctx: Context, spec: LLMDeploymentSpec, built: list[dict[str, Any]]
) -> None:
    """An autoscaler that takes over a server Deployment at 0 replicas (``spec.replicas: 0``
    before, or KEDA scaled to zero and the spec switched to an HPA or to ``minReplicas >= 1``)
    starts it at ``minReplicas``: an HPA never scales a Deployment up from 0 (scaling is
    disabled there), and a deleted ScaledObject leaves the count where it was."""
    a = spec.autoscaling
    if not a.enabled or a.minReplicas < 1:
        return
    live = await kube.get("apps/v1", "Deployment", ctx.namespace, ctx.name)
    if live is not None and ((live.get("spec") or {}).get("replicas")) == 0:
        (deployment,) = [
            o for o in built if o["kind"] == "Deployment" and o["metadata"]["name"] == ctx.name
        ]
        deployment["spec"]["replicas"] = a.minReplicas


def restart_counts(pods: list[Mapping[str, Any]]) -> dict[str, int]:
    """Each pod that is not terminating nor ended (an evicted pod stays, phase Failed), by
    name: its containers' restarts, summed (pods are what the API holds: anything malformed
    counts 0)."""
    counts = {}
    for pod in pods:
        meta, status = _mapping(pod, "metadata"), _mapping(pod, "status")
        if meta.get("deletionTimestamp") or not isinstance(meta.get("name"), str):
            continue
        if status.get("phase") in ("Failed", "Succeeded"):
            continue
        containers = status.get("containerStatuses")
        counts[meta["name"]] = sum(
            c["restartCount"]
            for c in (containers if isinstance(containers, list) else [])
            if isinstance(c, Mapping) and type(c.get("restartCount")) is int
        )
    return counts


def unschedulable(pods: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, the scheduler's message) of each pod the scheduler could not place (pods
    are what the API holds: anything may be malformed, and is then skipped)."""
    stuck = []
    for pod in pods:
        meta, status = _mapping(pod, "metadata"), _mapping(pod, "status")
        if meta.get("deletionTimestamp") or not isinstance(meta.get("name"), str):
            continue
        conditions = status.get("conditions")
        for c in conditions if isinstance(conditions, list) else []:
            if isinstance(c, Mapping) and (c.get("type"), c.get("reason")) == (
                "PodScheduled",
                "Unschedulable",
            ):
                stuck.append((meta["name"], str(c.get("message") or "Unschedulable")))
    return sorted(stuck)


def _mapping(obj: Any, key: str) -> Mapping[str, Any]:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _status(
    ctx: Context,
    spec_replicas: int,
    previous: Mapping[str, Any],
    deployment: Mapping[str, Any],
    results: list[PodResult],
    desired_hash: str,
    pods: list[Mapping[str, Any]],
    step: Step,
) -> dict[str, Any]:
    d = deployment.get("status") or {}
    replicas, ready = int(d.get("replicas") or 0), int(d.get("readyReplicas") or 0)
    updated = int(d.get("updatedReplicas") or 0)
    wanted = int((deployment.get("spec") or {}).get("replicas", spec_replicas))
    conditions = previous.get("conditions") or []
    g = ctx.generation
    versions: dict[str, int | None] = {r.name: r.version for r in results if r.version is not None}
    for gone in previous.get("podConfigVersions") or {}:
        versions.setdefault(gone, None)  # merge patch: removed
    applied = _applied(ctx, results, step)
    progressing = updated < wanted or ready < wanted
    progress = ("RollingOut", f"{updated} of {wanted} replicas updated, {ready} ready")
    if progressing and (stuck := unschedulable(pods)):
        # The scheduler's own words (e.g. "0/2 nodes are available: 2 Insufficient
        # nvidia.com/gpu"): what `kubectl get llmd -o yaml` must tell a user who scaled past
        # the cluster's GPUs.
        name, message = stuck[0]
        count = "1 pod cannot" if len(stuck) == 1 else f"{len(stuck)} pods cannot"
        progress = ("Unschedulable", f"{count} be scheduled ({name}: {message})")
    elif not progressing:
        progress = ("Complete", progress[1])
    return {
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": ",".join(f"{k}={v}" for k, v in selector(ctx.name, "server").items()),
        "observedGeneration": g,
        "schedulerConfigVersion": ctx.config_version,
        "schedulerConfigHash": desired_hash,
        "podConfigVersions": versions,
        "conditions": [
            condition(
                conditions,
                "Ready",
                "True" if ready > 0 else "False",
                "ReplicasReady" if ready > 0 else "NoReadyReplicas",
                f"{ready} of {wanted} replicas ready",
                g,
            ),
            condition(conditions, "Progressing", "True" if progressing else "False", *progress, g),
            condition(conditions, "SchedulerConfigApplied", *applied, g),
            *([condition(conditions, "Rollout", *step.condition, g)] if step.condition else []),
        ],
        "rollout": replacing(previous.get("rollout"), step.record),
    }


def _applied(ctx: Context, results: list[PodResult], step: Step) -> tuple[str, str, str]:
    """``SchedulerConfigApplied``: every ready pod at the settings pushed to it, and those
    the spec's (a rollout under way or rolled back says so instead)."""
    pending = sorted(r.name for r in results if not r.applied)
    if not results:
        return ("Unknown", "NoReadyPods", "no ready pod to apply the settings to")
    if pending:
        errors = "; ".join(f"{r.name}: {r.error}" for r in results if r.error)
        message = f"pods not at the desired settings: {', '.join(pending)}"
        return ("False", "Pending", message + (f" ({errors})" if errors else ""))
    if step.applied is not None:
        return step.applied
    running = "1 ready pod runs" if len(results) == 1 else f"{len(results)} ready pods run"
    return ("True", "Applied", f"{running} settings version {ctx.config_version}")
