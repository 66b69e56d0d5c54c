"""A change of the live settings rolled out by ``spec.rollout`` (docs/kubernetes.md, "A canary
rollout"): which pods get which settings, what the ConfigMap holds, and ``status.rollout``.

With ``strategy: canary`` a new settings hash goes to the canary pods only (the first ready
pods by name; at least one pod stays behind as the baseline); the other pods and the ConfigMap
(what new pods start on) keep the stable settings. Every reconcile during the bake scrapes the
pods' ``/metrics`` and judges the window since the rollout began (:mod:`iterserve.operator.gate`)::

    Baking --(bake over, gate holds)--------------> Promoted    (all pods, ConfigMap)
       |---(enough requests, gate broken: early)--> RolledBack  (canaries back; change rejected)
       |---(a canary's containers restarted)-------> RolledBack
       `---(bake over, too few requests)----------> Baking      (WaitingForTraffic)

Fewer than two ready pods leave nothing to compare: the change goes to every pod at once
(phase ``Unchecked``). The record lives in the resource's status, so an operator that restarts
resumes the bake where it was. A rejected change (its hash and settings version) is never
tried again; a new spec change has a new version and starts a new rollout.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from iterserve.config import LIVE_SCHEDULER_KEYS, SchedulerConfig
from iterserve.operator import gate
from iterserve.operator.push import PodTarget
from iterserve.operator.spec import RolloutSpec

BAKING, PROMOTED, ROLLED_BACK = "Baking", "Promoted", "RolledBack"
UNCHECKED, SUPERSEDED = "Unchecked", "Superseded"

# What a scrape of the ready pods found: pod name -> its histograms, None where it failed.
Scrape = Callable[[list[PodTarget]], Awaitable[dict[str, gate.Snapshot | None]]]


@dataclass(frozen=True)
class Settings:
    """Live settings (the server's keys), their hash and their version."""

    values: dict[str, Any]
    hash: str
    version: int


@dataclass(frozen=True)
class Push:
    """``settings`` to ``pods``."""

    pods: list[PodTarget]
    settings: Settings


@dataclass
class Step:
    """What one reconcile does with the settings.

    ``config_map``: what new pods start on. ``record``: ``status.rollout`` (None: removed).
    ``condition``: the ``Rollout`` condition (status, reason, message), None without a rollout.
    ``applied``: the ``SchedulerConfigApplied`` condition when every pod took its push, None
    for the usual one. ``outcome``: how a rollout ended in this step (for the metrics)."""

    pushes: list[Push]
    config_map: Settings
    record: dict[str, Any] | None = None
    condition: tuple[str, str, str] | None = None
    applied: tuple[str, str, str] | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)
    outcome: str | None = None


def limits_of(spec: RolloutSpec) -> gate.GateLimits:
    return gate.GateLimits(
        spec.maxTtftP99RegressionPct, spec.maxTpotP50RegressionPct, spec.minRequests
    )


def timestamp(now_s: float) -> str:
    """RFC 3339 in UTC, to the second (as Kubernetes writes times)."""
    return datetime.datetime.fromtimestamp(now_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds_of(stamp: str) -> float:
    """Seconds since the epoch of a :func:`timestamp`."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()


async def plan(
    spec: RolloutSpec,
    desired: Settings,
    stable: Settings | None,
    previous: Mapping[str, Any],
    pods: list[PodTarget],
    scrape: Scrape,
    now_s: float,
    restarts: Mapping[str, int] | None = None,
) -> Step:
    """The step of this reconcile (see the module docstring).

    Args:
        desired: what the spec asks for. stable: what the ConfigMap holds (None: no
            ConfigMap yet, nothing to roll from; or deleted during a rollout of
            ``desired``, whose record then says what was stable). previous:
            ``status.rollout`` so far.
        pods: the ready server pods. scrape: reads their ``/metrics``. now_s: epoch seconds.
        restarts: every server pod that exists (ready or not, not terminating) and its
            containers' restarts; None: unknown (then a canary not ready is taken as gone).
    """
    everyone = Step([Push(pods, desired)], desired)
    same = (previous.get("targetHash"), previous.get("targetVersion")) == (
        desired.hash,
        desired.version,
    )
    phase = previous.get("phase")
    if stable is None and same and phase in (BAKING, ROLLED_BACK) and _intact_stable(previous):
        stable = _stable_of(previous)  # the ConfigMap deleted mid-rollout: the record's
    if spec.strategy == "all" or stable is None:
        return everyone
    if same and phase == BAKING and _intact(previous):
        stable = _stable_of(previous)
        return await _bake(spec, desired, stable, previous, pods, scrape, now_s, restarts)
    if same and phase == BAKING:  # a record edited by hand: the bake starts again
        return await _start(spec, desired, stable, pods, scrape, now_s, restarts)
    if same and phase == ROLLED_BACK:  # rejected: not tried again
        message = f"settings version {desired.version} rolled back: {previous.get('message')}"
        rejected: tuple[str, str, str] = ("False", ROLLED_BACK, message)
        return Step([Push(pods, stable)], stable, dict(previous), rejected, rejected)
    if same or desired.hash == stable.hash:  # nothing new: ended rollouts keep their record
        condition = _ended_condition(previous)
        record = _ended(previous) or None
        if record is not None and phase in (BAKING, ROLLED_BACK) and not same:
            record["phase"] = SUPERSEDED  # the spec went back to the stable settings
        return Step(everyone.pushes, desired, record, condition)
    return await _start(spec, desired, stable, pods, scrape, now_s, restarts)


def _intact(record: Mapping[str, Any]) -> bool:
    """Whether a bake's record (``status.rollout``, which anyone may edit) is as
    :func:`_start` wrote it."""
    try:
        _stable_of(record)
        seconds_of(record["startedAt"])
        pods, start = record["canaryPods"], record["windowStart"]
        pending = record.get("windowPending", [])
        return (
            all(isinstance(names, list) for names in (pods, pending))
            and all(isinstance(p, str) for p in [*pods, *pending])
            and isinstance(start, Mapping)
            and all(_is_snapshot(s) for s in start.values())
        )
    except (KeyError, TypeError, ValueError):
        return False


def _window_fields(start: Mapping[str, gate.Snapshot | None]) -> dict[str, Any]:
    """The window's start as the record holds it: ``windowStart`` the pods' snapshots, and
    ``windowPending`` the pods whose scrape failed (not None in ``windowStart``: the status
    is a JSON merge patch, where null deletes the key, and the pod would count whole)."""
    snapshots = {
        pod: {name: b for name, b in snapshot.items() if name != gate.CONFIG}
        for pod, snapshot in start.items()
        if snapshot is not None
    }
    fields: dict[str, Any] = {"windowStart": snapshots}
    if pending := sorted(k for k, v in start.items() if v is None):
        fields["windowPending"] = pending
    return fields


def _window_start(record: Mapping[str, Any]) -> dict[str, gate.Snapshot | None]:
    """The inverse of :func:`_window_fields`."""
    start: dict[str, gate.Snapshot | None] = dict(record["windowStart"])
    start.update(dict.fromkeys(record.get("windowPending", [])))
    return start


def _intact_stable(record: Mapping[str, Any]) -> bool:
    try:
        _stable_of(record)
        return True
    except (KeyError, TypeError, ValueError):
        return False


def _is_snapshot(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(b, Mapping)
        and all(
            isinstance(n, int | float) and not isinstance(n, bool) and 0 <= n < math.inf
            for n in b.values()
        )
        for b in value.values()
    )


# Live settings that may be null (their default): the status is a JSON merge patch, where a
# null deletes the key, so stableSettings comes back without them.
_NULLABLE = tuple(k for k in LIVE_SCHEDULER_KEYS if getattr(SchedulerConfig(), k, 0) is None)


def _stable_of(record: Mapping[str, Any]) -> Settings:
    """The stable settings a bake keeps, exactly as they were: JSON text in the record,
    because the status is written as a JSON merge patch (a null value deletes its key) and
    read back through the API server (``2000.0`` comes back ``2000``): as a mapping, they
    would return with other values and another hash, and a rollback would push those (a
    record written as a mapping by an earlier operator: its nullable keys restored)."""
    stored = record["stableSettings"]
    values = (
        json.loads(stored) if isinstance(stored, str) else {**dict.fromkeys(_NULLABLE), **stored}
    )
    if not isinstance(values, dict):
        raise TypeError("stableSettings is not a mapping")
    return Settings(values, record["stableHash"], int(record["stableVersion"]))


# Kept while a bake runs, dropped when it ends: the window's bucket counts (tens per pod) would
# stay in every ``kubectl get -o yaml``. A rolled-back record keeps ``stableSettings`` (the
# settings its pods must stay on, should the ConfigMap go); a promoted or superseded one
# drops them too.
_WINDOW = ("windowStart", "windowPending", "canaryRestarts")


def _ended(record: Mapping[str, Any], keep_stable: bool = False, **changes: Any) -> dict[str, Any]:
    dropped = _WINDOW if keep_stable else (*_WINDOW, "stableSettings")
    return {**{k: v for k, v in record.items() if k not in dropped}, **changes}


def _ended_condition(record: Mapping[str, Any]) -> tuple[str, str, str] | None:
    phase = record.get("phase")
    if phase == PROMOTED:
        return ("True", PROMOTED, str(record.get("message")))
    if phase == UNCHECKED:
        return ("True", UNCHECKED, str(record.get("message")))
    if phase in (ROLLED_BACK, BAKING, SUPERSEDED):
        version = record.get("targetVersion")
        message = f"the spec went back to the stable settings from version {version}"
        return ("True", SUPERSEDED, message)
    return None


async def _start(
    spec: RolloutSpec,
    desired: Settings,
    stable: Settings,
    pods: list[PodTarget],
    scrape: Scrape,
    now_s: float,
    restarts: Mapping[str, int] | None = None,
) -> Step:
    """A new rollout: canaries chosen, the window's start scraped."""
    record: dict[str, Any] = {
        "targetHash": desired.hash,
        "targetVersion": desired.version,
        "stableHash": stable.hash,
        "stableVersion": stable.version,
        "startedAt": timestamp(now_s),
    }
    if len(pods) < 2:
        message = (
            f"settings version {desired.version} went to every pod unchecked: "
            f"{len(pods)} ready pod(s), a canary needs another pod to compare with"
        )
        record.update(phase=UNCHECKED, canaryPods=[], message=message)
        step = Step([Push(pods, desired)], desired, record, ("True", UNCHECKED, message))
        step.events.append(("Normal", "RolloutUnchecked", message))
        step.outcome = "unchecked"
        return step
    ordered = sorted(pods, key=lambda p: p.name)
    canaries = ordered[: min(spec.canaryPods, len(ordered) - 1)]
    snapshots = await scrape(ordered)
    names = ", ".join(p.name for p in canaries)
    message = (
        f"settings version {desired.version} on canary pod(s) {names} for "
        f"{spec.bakeSeconds} s; the other pods stay on version {stable.version}"
    )
    record.update(
        phase=BAKING,
        stableSettings=json.dumps(stable.values, sort_keys=True),  # see _stable_of
        canaryPods=[p.name for p in canaries],
        canaryRestarts={p.name: (restarts or {}).get(p.name, 0) for p in canaries},
        **_window_fields(snapshots),
        message=message,
    )
    rest = ordered[len(canaries) :]
    step = Step([Push(canaries, desired), Push(rest, stable)], stable, record)
    step.condition = step.applied = ("Unknown", BAKING, message)
    step.events.append(("Normal", "RolloutStarted", message))
    return step


async def _bake(
    spec: RolloutSpec,
    desired: Settings,
    stable: Settings,
    record: Mapping[str, Any],
    pods: list[PodTarget],
    scrape: Scrape,
    now_s: float,
    restarts: Mapping[str, int] | None = None,
) -> Step:
    """A rollout under way: judged on the window so far."""
    canaries = [p for p in pods if p.name in record["canaryPods"]]
    rest = [p for p in pods if p.name not in record["canaryPods"]]
    if crashed := _restarted(record, restarts):
        return _rolled_back(desired, stable, record, pods, f"pod {crashed} restarted in the bake")
    there = restarts is not None and any(n in restarts for n in record["canaryPods"])
    if not canaries and len(pods) >= 2 and not there:  # the canaries went: new ones, a window
        return await _start(spec, desired, stable, pods, scrape, now_s, restarts)
    if not canaries or not rest:  # one group has no ready pod (restarting): wait for it
        message = (
            f"settings version {desired.version} baking: waiting for a ready "
            f"{'baseline' if canaries else 'canary'} pod to compare with"
        )
        step = Step([Push(canaries, desired), Push(rest, stable)], stable, dict(record))
        step.condition = step.applied = ("Unknown", "WaitingForPods", message)
        return step
    start, scraped = _window_start(record), await scrape(pods)
    for pod in canaries:  # not on the change (its push failed): no window so far
        running = gate.hash_of(scraped.get(pod.name))
        if running is not None and running != desired.hash:
            start[pod.name] = scraped[pod.name] = None
    verdict = judge_window(start, scraped, canaries, limits_of(spec))
    elapsed_s = now_s - seconds_of(record["startedAt"])
    new = dict(record)
    # A pod whose scrape failed at the start has its window from its first good scrape (else
    # a lone canary that was slow once would never count, and the bake never end).
    late = {pod: scraped[pod] for pod in start if start[pod] is None and scraped.get(pod)}
    new.pop("windowPending", None)
    new.update(_window_fields({**start, **late}))
    if verdict.enough and not verdict.within:
        message = f"beyond the gate after {elapsed_s:.0f} s: {verdict.text()}"
        return _rolled_back(desired, stable, new, pods, message)
    if verdict.enough and elapsed_s >= spec.bakeSeconds:
        message = f"settings version {desired.version} promoted: {verdict.text()}"
        new = _ended(record, phase=PROMOTED, message=message)
        step = Step([Push(pods, desired)], desired, new, ("True", PROMOTED, message))
        step.events.append(("Normal", "RolloutPromoted", message))
        step.outcome = "promoted"
        return step
    reason = "WaitingForTraffic" if elapsed_s >= spec.bakeSeconds else BAKING
    message = (
        f"settings version {desired.version} on {', '.join(p.name for p in canaries)} "
        f"for {elapsed_s:.0f} of {spec.bakeSeconds} s: {verdict.text()}"
    )
    new["message"] = message
    step = Step([Push(canaries, desired), Push(rest, stable)], stable, new)
    step.condition = step.applied = ("Unknown", reason, message)
    return step


def _restarted(record: Mapping[str, Any], restarts: Mapping[str, int] | None) -> str | None:
    """A canary whose containers restarted since the rollout began (a change that crashes
    the engine: the pod comes back on the ConfigMap's settings, and would get it again)."""
    before = record.get("canaryRestarts")
    if restarts is None or not isinstance(before, Mapping):
        return None
    for name in record["canaryPods"]:
        count = before.get(name)
        if isinstance(count, int) and restarts.get(name, count) > count:
            return str(name)
    return None


def _rolled_back(
    desired: Settings,
    stable: Settings,
    record: Mapping[str, Any],
    pods: list[PodTarget],
    message: str,
) -> Step:
    """The change rejected: every pod and the ConfigMap on ``stable``."""
    new = _ended(
        record, keep_stable=True, phase=ROLLED_BACK, message=message, rejectedHash=desired.hash
    )
    text = f"settings version {desired.version} rolled back: {message}"
    condition = ("False", ROLLED_BACK, text)
    step = Step([Push(pods, stable)], stable, new, condition, condition)
    step.events.append(("Warning", "RolloutRolledBack", text))
    step.outcome = "rolled_back"
    return step


def judge_window(
    start: Mapping[str, gate.Snapshot | None],
    now: Mapping[str, gate.Snapshot | None],
    canaries: list[PodTarget],
    limits: gate.GateLimits,
) -> gate.Verdict:
    """The gate on the window from ``start`` (the scrape when the rollout began) to ``now``.
    A pod is left out when a scrape of it failed (now, or at the start while it was ready:
    :func:`plan` then starts its window at its next good scrape); a pod that was not there
    at the start counts whole (it began in the window)."""
    names = {p.name for p in canaries}
    groups: dict[bool, gate.Snapshot] = {True: {}, False: {}}
    for pod, snapshot in now.items():
        if snapshot is None or (pod in start and start[pod] is None):
            continue
        before = start.get(pod) or {}
        group = groups[pod in names]
        for name in gate.GATED:
            delta = gate.window(before.get(name), snapshot.get(name, {}))
            group[name] = gate.add(group.get(name, {}), delta)
    return gate.judge(groups[True], groups[False], limits)


def replacing(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386, what kopf sends for a status) that turns ``old`` into
    ``new``: a key ``new`` lacks is null, at every depth (a merge patch of ``new`` alone would
    keep the old record's keys, such as a finished rollout's ``rejectedHash``)."""
    if not isinstance(new, dict) or not isinstance(old, Mapping):
        return new
    patch = {key: replacing(old.get(key), value) for key, value in new.items()}
    patch.update({key: None for key in old if key not in new})
    return patch


def scrape_pods(timeout_s: float) -> Scrape:
    """A :data:`Scrape` over HTTP: ``GET /metrics`` on each pod's API port at once, each
    bounded by ``timeout_s``; a pod that fails (unreachable, not 200, not the text format) is
    None."""

    async def scrape(pods: list[PodTarget]) -> dict[str, gate.Snapshot | None]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # as push.sync_pods: no pod waits for a slot
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            found = await asyncio.gather(*(_scrape_one(http, p) for p in pods))
        return {p.name: snapshot for p, snapshot in zip(pods, found, strict=True)}

    return scrape


async def _scrape_one(http: aiohttp.ClientSession, pod: PodTarget) -> gate.Snapshot | None:
    """The pod's histograms, and the settings hash it runs (:data:`gate.CONFIG`) when its
    ``/load`` says."""
    try:
        async with http.get(pod.url + "/metrics", allow_redirects=False) as r:
            if r.status != 200:
                return None
            snapshot = gate.parse_snapshot(await r.text())
    except Exception:  # any failure leaves this pod out of the window, never the others
        return None
    try:
        async with http.get(pod.url + "/load", allow_redirects=False) as r:
            running = (await r.json(content_type=None)).get("config_hash") if r.ok else None
        if isinstance(running, str):
            snapshot[gate.CONFIG] = {running: 1.0}
    except Exception:  # the window without the check: as before /load said
        pass
    return snapshot
