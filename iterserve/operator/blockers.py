"""Why a running operator does nothing, said at the default log level.

kopf (1.45) pauses every watch, and says why only at debug level, while its peering is
mandatory (``iterserve operator run`` without ``--standalone`` gives kopf a peering name) and

- the peering CRD is not installed (kopf's blocker "peering CRD is missing"), or
- the peering object named ``iterserve`` does not exist (blocker ``iterserve@None``, or
  ``iterserve@NAMESPACE`` per watched namespace): kopf starts paused and resumes only on a
  watch event of that object.

It also watches nothing while the LLMDeployment CRD is not installed, with one warning at
start ("Unresolved resources cannot be served") and silence after. (A pause in favour of
another operator instance kopf logs itself, at warning level.) kopf exposes none of this
state, so :func:`find_blockers` asks the API server with the list requests kopf makes (the
chart's RBAC grants them), and :func:`warn_while_blocked` warns at start and again every
``warn_interval_s`` while a blocker remains.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kubernetes.aio.client.exceptions import ApiException

from iterserve.operator.checks import DNS_1123_LABEL
from iterserve.operator.kube import Kube
from iterserve.operator.spec import GROUP, KIND, PLURAL, VERSION

logger = logging.getLogger(__name__)

PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"
CHECK_INTERVAL_S = 10.0
WARN_INTERVAL_S = 30.0
_STANDALONE_HINT = "or run with --standalone if no other instance of the operator can run"


@dataclass(frozen=True)
class Watch:
    """What the operator watches and how kopf peers: ``namespaces`` empty = cluster-wide;
    ``peering`` the peering object's name when peering is mandatory, None when standalone."""

    namespaces: tuple[str, ...] = ()
    peering: str | None = None


async def find_blockers(kube: Kube, watch: Watch) -> list[str]:
    """Why kopf serves nothing now, one message per cause naming what is missing and how to
    fix it; empty when nothing blocks. Namespace patterns (``team-*``, ``!kube-system``),
    which kopf resolves by listing namespaces, are not checked.

    Raises:
        aiohttp.ClientError, OSError: the API server did not answer.
    """
    scopes: list[str | None] = (
        [ns for ns in watch.namespaces if DNS_1123_LABEL.fullmatch(ns)]
        if watch.namespaces
        else [None]
    )
    found: list[str] = []
    for namespace in scopes:
        try:
            await kube.list_custom(GROUP, VERSION, PLURAL, namespace, limit=1)
        except ApiException as e:
            found.append(
                _crd_missing() if e.status == 404 else _cannot_list(PLURAL, GROUP, namespace, e)
            )
        if watch.peering is not None:
            found += await _peering_blockers(kube, watch.peering, namespace)
    return list(dict.fromkeys(found))  # a CRD missing is said once, not per namespace


async def _peering_blockers(kube: Kube, name: str, namespace: str | None) -> list[str]:
    # kopf peers through the ClusterKopfPeering when cluster-wide, else through the
    # KopfPeering of each watched namespace.
    kind = "ClusterKopfPeering" if namespace is None else "KopfPeering"
    plural = f"{kind.lower()}s"
    try:
        found = await kube.list_custom(PEERING_GROUP, PEERING_VERSION, plural, namespace, name=name)
    except ApiException as e:
        if e.status != 404:
            return [_cannot_list(plural, PEERING_GROUP, namespace, e)]
        return [
            f"kopf's peering is on (no --standalone) but its CRD {plural}.{PEERING_GROUP} is not "
            f"installed, so kopf pauses every watch: install it (kubectl apply -f "
            f"crds/{plural}.{PEERING_GROUP}.yaml) and create the {kind} named {name} "
            f"(charts/iterserve/templates/peering.yaml; the Helm chart installs both), "
            f"{_STANDALONE_HINT}"
        ]
    if found:
        return []
    where = "" if namespace is None else f" in namespace {namespace}"
    meta = f"{{name: {name}}}" if namespace is None else f"{{name: {name}, namespace: {namespace}}}"
    manifest = f"{{apiVersion: {PEERING_GROUP}/{PEERING_VERSION}, kind: {kind}, metadata: {meta}}}"
    return [
        f"kopf's peering is on (no --standalone) but no {kind} named {name} exists{where}, so "
        f"kopf pauses every watch until it does: create it (charts/iterserve/templates/"
        f"peering.yaml, which the Helm chart installs, or echo '{manifest}' | kubectl apply "
        f"-f -), {_STANDALONE_HINT}"
    ]


def _crd_missing() -> str:
    return (
        f"the {KIND} CRD ({PLURAL}.{GROUP}) is not installed, so there is nothing to watch: "
        f"install it (kubectl apply -f crds/{PLURAL}.{GROUP}.yaml; the Helm chart installs it)"
    )


def _cannot_list(plural: str, group: str, namespace: str | None, e: ApiException) -> str:
    where = "in any namespace" if namespace is None else f"in namespace {namespace}"
    if e.status == 403:
        return (
            f"the operator may not list {plural}.{group} {where} (403 Forbidden): grant it "
            "list, watch and patch (the Helm chart's RBAC does)"
        )
    return f"listing {plural}.{group} {where} failed: {e.status} {str(e.reason)[:200]}"


async def warn_while_blocked(
    check: Callable[[], Awaitable[list[str]]],
    *,
    check_interval_s: float = CHECK_INTERVAL_S,
    warn_interval_s: float = WARN_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Run ``check`` (:func:`find_blockers`) every ``check_interval_s`` until cancelled: one
    WARNING per blocker at once, again every ``warn_interval_s`` while they last (at once when
    they change), one INFO when they are gone. A failed check is warned the same way."""
    warned: list[str] = []
    warned_at = -math.inf
    while True:
        try:
            blockers = await check()
        except Exception as e:  # a diagnostic must outlive what it diagnoses
            blockers = [f"the operator could not ask the Kubernetes API why: {e!r}"]
        now = clock()
        if blockers and (blockers != warned or now - warned_at >= warn_interval_s):
            for blocker in blockers:
                logger.warning("Nothing is reconciled: %s.", blocker)
            warned, warned_at = blockers, now
        elif not blockers and warned:
            logger.info("Resolved, kopf resumes: %s.", "; ".join(warned))
            warned = []
        await sleep(check_interval_s)
