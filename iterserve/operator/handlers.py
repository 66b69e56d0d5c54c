"""The kopf handlers of ``LLMDeployment``, thin over :func:`iterserve.operator.reconcile.reconcile`.

Create, update and resume reconcile at once; a timer (``--resync-interval-s``) reconciles
again, which corrects drift in owned objects and catches up pods that missed a push (new,
restarted, unreachable at the time). An invalid spec sets ``Ready=False`` and applies nothing
(:class:`kopf.PermanentError`); an API failure is retried with backoff
(:class:`kopf.TemporaryError`). Deleting the resource deletes what it owns (owner
references; garbage collection). While kopf is paused or has nothing to watch (a peering object
or a CRD missing), a background check says why at warning level
(:mod:`iterserve.operator.blockers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from kubernetes.aio.client.exceptions import ApiException

from iterserve.operator.blockers import Watch, find_blockers, warn_while_blocked
from iterserve.operator.kube import Kube
from iterserve.operator.login import api_client, connection_info
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.reconcile import Outcome, invalid_status, reconcile
from iterserve.operator.spec import GROUP, PLURAL, VERSION, SpecError

RESOURCE = (GROUP, VERSION, PLURAL)
RETRY_DELAY_S = 5.0
# How long a peering record counts as alive (kopf's default: 60 s). A crashed operator's record
# outlives it, and its replacement pauses until the record expires (a "conflicting operator
# with the same priority"): measured on the local control plane, a SIGKILLed operator held
# every change ~55 s. kopf refreshes its own record every lifetime - 5..10 s.
PEERING_LIFETIME_S = 15


def build_registry(resync_interval_s: float = 10.0) -> kopf.OperatorRegistry:
    """A kopf registry with every handler (``kopf.run(registry=...)``); the timer every
    ``resync_interval_s``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = "iterserve.io/operator"
        settings.posting.level = logging.INFO  # Normal events and up
        # On deletion kopf stops the resync timer, then looks again this often (default 60 s:
        # a deleted resource would wait a minute for its finalizer to go).
        settings.background.cancellation_polling = 1.0
        settings.peering.lifetime = PEERING_LIFETIME_S
        memo.kube = Kube(await api_client(memo.get("kubeconfig")))
        memo.reconcile_guards = {}  # by uid: see _Guard
        # kopf pauses silently (debug level) while mandatory peering lacks its CRD or object.
        peering = settings.peering
        watch = Watch(
            namespaces=memo.settings.namespaces,
            peering=peering.name if peering.mandatory and not peering.standalone else None,
        )
        memo.blocker_warnings = asyncio.create_task(
            warn_while_blocked(lambda: find_blockers(memo.kube, watch)), name="blocker warnings"
        )

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        memo.blocker_warnings.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await memo.blocker_warnings
        await memo.kube.api.close()

    @kopf.on.login(registry=registry)
    async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
        return await connection_info(memo.get("kubeconfig"))

    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    @kopf.on.resume(*RESOURCE, registry=registry)
    async def apply_resource(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
        await _reconcile(body, patch, memo, permanent=True)

    @kopf.on.delete(*RESOURCE, registry=registry, optional=True)
    async def forget(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        meta = body["metadata"]
        memo.get("reconcile_guards", {}).pop(str(meta.get("uid")), None)
        if (metrics := memo.get("metrics")) is not None:
            metrics.forget(meta["namespace"], meta["name"], meta.get("uid"))

    @kopf.timer(*RESOURCE, registry=registry, interval=resync_interval_s, idle=0.0)
    async def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
        if not body.get("metadata", {}).get("deletionTimestamp"):
            await _reconcile(body, patch, memo, permanent=False)

    return registry


@dataclass
class _Guard:
    """One resource's reconciles, one at a time: kopf runs timers beside the change handlers,
    and a resync that pushed the settings of the generation before a change to pods the
    change had just reached made each pod apply them, then the change again, as new
    versions (``podConfigVersions`` 4 for generation 2, seen on the local control plane)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    generation: int = 0  # the newest generation reconciled


async def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, permanent: bool) -> None:
    """Reconcile ``body`` (``permanent``: a change handler, else the resync timer). A resync
    while another reconcile of the resource runs, or one with a body older than the newest
    generation reconciled, does nothing: the change handler does (or did) the work."""
    guards: dict[str, _Guard] = memo.setdefault("reconcile_guards", {})
    meta = body.get("metadata") or {}
    guard = guards.setdefault(str(meta.get("uid")), _Guard())
    generation = int(meta.get("generation") or 0)
    if not permanent and (guard.lock.locked() or generation < guard.generation):
        return
    async with guard.lock:
        if not permanent and generation < guard.generation:
            return
        guard.generation = max(guard.generation, generation)
        await _reconcile_now(body, patch, memo, permanent)


async def _reconcile_now(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, permanent: bool
) -> None:
    metrics: OperatorMetrics | None = memo.get("metrics")
    try:
        outcome = await _counted(reconcile(memo.kube, body, memo.settings), body, metrics)
    except SpecError as e:
        patch.status.update(invalid_status(body, str(e)))
        conditions = (body.get("status") or {}).get("conditions") or []
        reported = any(
            (c.get("type"), c.get("reason"), c.get("message")) == ("Ready", "InvalidSpec", str(e))
            for c in conditions
        )
        # The timer finds the same invalid spec every pass: one event, not one per pass.
        if permanent or not reported:
            kopf.warn(body, reason="InvalidSpec", message=str(e))
        if permanent:
            raise kopf.PermanentError(str(e)) from e
        return
    except ApiException as e:
        raise kopf.TemporaryError(f"Kubernetes API: {e.status} {e.reason}", RETRY_DELAY_S) from e
    except (aiohttp.ClientError, TimeoutError) as e:
        # The API server unreachable (restarting, a connection reset): soon again, not after
        # kopf's default backoff of 60 s for an unexpected error.
        raise kopf.TemporaryError(f"Kubernetes API unreachable: {e}", RETRY_DELAY_S) from e
    patch.status.update(outcome.status)
    if metrics is not None:
        metrics.record(body, outcome.push_s, outcome.num_pods_behind, outcome.rollout_outcome)
    for kind, reason, message in outcome.events:
        (kopf.info if kind == "Normal" else kopf.warn)(body, reason=reason, message=message)


async def _counted(
    reconciling: Awaitable[Outcome], body: kopf.Body, metrics: OperatorMetrics | None
) -> Outcome:
    """``reconciling`` awaited; a failure counted by its outcome (success is counted with the
    rest of the outcome's figures, :meth:`OperatorMetrics.record`)."""
    try:
        return await reconciling
    except Exception as e:
        if metrics is not None:
            if isinstance(e, SpecError):
                outcome = "invalid_spec"
            elif isinstance(e, ApiException):
                outcome = "api_error"
            elif isinstance(e, aiohttp.ClientError | TimeoutError):
                outcome = "api_unreachable"
            else:
                outcome = "error"
            metrics.failed(body, outcome)
        raise
