"""Live scheduler settings to the server pods: ``GET /load``, ``PUT /admin/scheduler_config``.

A pod is reached at ``http://{status.podIP}:{its container port named http}`` (DESIGN.md).
Every ready pod is asked at once, each with bounded timeouts, so one slow or dead pod costs
the others nothing. A pod counts as applied when the ``config_hash`` of its ``/load`` equals
the desired settings' hash; only pods that differ get the PUT, with ``config_version`` =
the version the operator assigns (the resource's generation of the last settings change).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class PodTarget:
    """A ready server pod and where its API listens."""

    name: str
    url: str


@dataclass(frozen=True)
class PodResult:
    """What a pod said: its version and whether its settings are the desired ones, or why
    it could not be reached."""

    name: str
    version: int | None
    applied: bool
    pushed: bool = False
    error: str | None = None


def ready_targets(pods: list[dict[str, Any]]) -> list[PodTarget]:
    """The pods that are Ready, not terminating, with an IP and a container port ``http``."""
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        conditions = status.get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            continue
        ports = [
            p["containerPort"]
            for c in pod.get("spec", {}).get("containers", [])
            for p in c.get("ports", [])
            if p.get("name") == "http"
        ]
        if ports:
            targets.append(PodTarget(meta["name"], f"http://{status['podIP']}:{ports[0]}"))
    return targets


async def sync_pod(
    http: aiohttp.ClientSession,
    pod: PodTarget,
    settings: dict[str, Any],
    desired_hash: str,
    version: int,
    admin_token: str,
) -> PodResult:
    """Bring one pod to ``settings``: nothing when its hash already matches."""
    try:
        async with http.get(pod.url + "/load") as r:
            r.raise_for_status()
            load = json.loads(await r.read())
        if load.get("config_hash") == desired_hash:
            return PodResult(pod.name, load.get("config_version"), applied=True)
        headers = {"Authorization": f"Bearer {admin_token}"}
        body = {**settings, "config_version": version}
        async with http.put(pod.url + "/admin/scheduler_config", json=body, headers=headers) as r:
            answer = json.loads(await r.read())
            if r.status != 200:
                message = answer.get("error", {}).get("message", answer)
                return PodResult(pod.name, None, False, error=f"{r.status}: {message}")
        applied = answer.get("config_hash") == desired_hash
        return PodResult(pod.name, answer.get("config_version"), applied, pushed=True)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return PodResult(pod.name, None, False, error=f"{type(e).__name__}: {e}")


async def sync_pods(
    pods: list[PodTarget],
    settings: dict[str, Any],
    desired_hash: str,
    version: int,
    admin_token: str,
    timeout_s: float = 5.0,
) -> list[PodResult]:
    """:func:`sync_pod` on every pod at once, each bounded by ``timeout_s``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        return list(
            await asyncio.gather(
                *(sync_pod(http, p, settings, desired_hash, version, admin_token) for p in pods)
            )
        )
