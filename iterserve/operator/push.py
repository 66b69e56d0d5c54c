"""Live scheduler settings to the server pods: ``GET /load``, ``PUT /admin/scheduler_config``.

A pod's ``/load`` is read at ``http://{status.podIP}:{its container port named http}``, and the
PUT goes to its container port named ``admin`` (``--admin-port``; the ``http`` port on pods
without one). The PUT carries the current admin token, and on a 401 the previous one: during
a rotation a pod whose Secret file the kubelet has not yet refreshed still accepts it.
Every ready pod is asked at once, each with bounded timeouts, so one slow or dead pod costs
the others nothing. A pod counts as applied when the ``config_hash`` of its ``/load`` equals
the desired settings' hash; only pods that differ get the PUT, with ``config_version`` =
the version the operator assigns (the resource's generation of the last settings change).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class PodTarget:
    """A ready server pod, where its API listens (``url``) and where its admin API does
    (``admin_url``; default: ``url``)."""

    name: str
    url: str
    admin_url: str | None = None

    @property
    def admin(self) -> str:
        return self.admin_url or self.url


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
        ports = {
            p.get("name"): p["containerPort"]
            for c in pod.get("spec", {}).get("containers", [])
            for p in c.get("ports", [])
        }
        if "http" in ports:
            ip = status["podIP"]
            host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod (dual-stack, IPv6 clusters)
            admin = f"http://{host}:{ports['admin']}" if "admin" in ports else None
            targets.append(PodTarget(meta["name"], f"http://{host}:{ports['http']}", admin))
    return targets


async def sync_pod(
    http: aiohttp.ClientSession,
    pod: PodTarget,
    settings: dict[str, Any],
    desired_hash: str,
    version: int,
    admin_tokens: str | Sequence[str],
) -> PodResult:
    """Bring one pod to ``settings``: nothing when its hash already matches; else a PUT with
    ``admin_tokens[0]`` (the current token), then each next one (the previous) on a 401.

    Whatever the pod answers (a redirect, which is not followed: the admin token goes to the
    pod only; JSON that is not an object; an error page) is a :class:`PodResult` with the
    error, never an exception: one odd pod must not cost the others their status."""
    try:
        async with http.get(pod.url + "/load", allow_redirects=False) as r:
            if r.status != 200:
                return PodResult(pod.name, None, False, error=f"/load answered {r.status}")
            load = _object(await r.read())
        if load.get("config_hash") == desired_hash:
            return PodResult(pod.name, _version(load), applied=True)
        body = {**settings, "config_version": version}
        url = pod.admin + "/admin/scheduler_config"
        status, text = 401, b'{"error": {"message": "no admin token to send"}}'
        for token in (admin_tokens,) if isinstance(admin_tokens, str) else admin_tokens:
            headers = {"Authorization": f"Bearer {token}"}
            async with http.put(url, json=body, headers=headers, allow_redirects=False) as r:
                status, text = r.status, await r.read()
            if status != 401:
                break
        if status != 200:
            return PodResult(pod.name, None, False, error=f"{status}: {_error_message(text)}")
        answer = _object(text)
        applied = answer.get("config_hash") == desired_hash
        return PodResult(pod.name, _version(answer), applied, pushed=True)
    except Exception as e:  # any failure is this pod's, never the others'
        return PodResult(pod.name, None, False, error=f"{type(e).__name__}: {e}")


def _error_message(text: bytes) -> Any:
    """The ``error.message`` of an OpenAI-shaped error body, else the body's start."""
    try:
        error = _object(text).get("error")
        return error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        return text[:200].decode(errors="replace")


def _object(data: bytes) -> dict[str, Any]:
    """A JSON object (ValueError otherwise: not JSON, or a list, a string, null)."""
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _version(answer: dict[str, Any]) -> int | None:
    """The pod's ``config_version`` when it is an integer (status holds integers only)."""
    version = answer.get("config_version")
    return version if isinstance(version, int) and not isinstance(version, bool) else None


async def sync_pods(
    pods: list[PodTarget],
    settings: dict[str, Any],
    desired_hash: str,
    version: int,
    admin_tokens: str | Sequence[str],
    timeout_s: float = 5.0,
) -> list[PodResult]:
    """:func:`sync_pod` on every pod at once, each bounded by ``timeout_s`` (seconds).
    ``admin_tokens``: the current admin token first, then the previous one (if any); a
    single string is one token."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # No pool limit: with the default 100 connections, pods beyond the hundredth would wait
    # for a free one inside their own timeout and be reported unreachable.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        return list(
            await asyncio.gather(
                *(sync_pod(http, p, settings, desired_hash, version, admin_tokens) for p in pods)
            )
        )


async def pods_refusing(
    pods: list[PodTarget], admin_token: str, timeout_s: float = 5.0
) -> list[str]:
    """The pods whose admin API answers 401 to ``admin_token`` (``GET
    /admin/scheduler_config``), by name: those whose Secret volume the kubelet has not
    refreshed yet. A pod that cannot be reached refuses nothing (a push skips it anyway)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Authorization": f"Bearer {admin_token}"}

    async def refuses(http: aiohttp.ClientSession, pod: PodTarget) -> bool:
        url = pod.admin + "/admin/scheduler_config"
        try:
            async with http.get(url, headers=headers, allow_redirects=False) as r:
                return r.status == 401
        except Exception:  # unreachable: not this check's business
            return False

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        answers = await asyncio.gather(*(refuses(http, p) for p in pods))
    return [p.name for p, refused in zip(pods, answers, strict=True) if refused]
