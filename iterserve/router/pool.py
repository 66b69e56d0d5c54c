"""The router's replicas: their load reports, in-flight counts, ejection and probing back.

Every proxied attempt is bracketed by :meth:`ReplicaPool.begin_attempt` and
:meth:`~ReplicaPool.end_attempt`: the pool alone changes a replica's in-flight numbers.

Each replica is polled every ``poll_interval_s`` with a bounded timeout (iterserve: ``/load``;
vLLM and SGLang: ``/metrics``; see :mod:`iterserve.router.backends`). A replica is *ready*
while its last poll succeeded and it is not ejected. ``eject_after`` consecutive failures
(polls or proxied requests failing before their first byte) eject it; it is probed back after
a backoff that doubles on every failed probe (``backoff_s`` .. ``max_backoff_s``); one good
poll re-admits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from iterserve.router.backends import (
    LoadFormatError,
    detect_prometheus_type,
    parse_iterserve_load,
    parse_prometheus_load,
)
from iterserve.router.scoring import LoadReport, ReplicaState

logger = logging.getLogger("iterserve.router")


@dataclass
class Backend:
    """One replica as the router tracks it."""

    url: str
    kind: str  # iterserve | vllm | sglang | auto (until the first good poll)
    state: ReplicaState
    poll_failures: int = 0  # consecutive
    request_failures: int = 0  # consecutive, before a first byte
    ejected: bool = False
    next_probe_at: float = 0.0
    backoff_s: float = 0.0
    in_flight: int = 0  # requests being proxied to it now
    polls_ok: int = 0

    @property
    def name(self) -> str:
        return self.state.name


@dataclass(frozen=True)
class OpenAttempt:
    """A proxied request being sent to ``backend`` (:meth:`ReplicaPool.begin_attempt`), and
    the replica's report current when it began."""

    backend: Backend
    report: LoadReport | None


# GET a URL with headers: (status, body). Polls go through one (aiohttp's in the router).
Fetch = Callable[[str, dict[str, str]], Awaitable[tuple[int, bytes]]]


def aiohttp_fetch(session: aiohttp.ClientSession) -> Fetch:
    """A :data:`Fetch` over ``session``."""

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        # Not following a redirect: the replicas' key goes to the replicas only.
        async with session.get(url, headers=headers, allow_redirects=False) as r:
            return r.status, await r.read()

    return fetch


class PollStatusError(Exception):
    """A poll answered with an error status."""


@dataclass
class ReplicaPool:
    """The replicas behind the router (see the module docstring).

    Args:
        fetch: what polls go through (set before polling starts).
        backend_type: ``auto``, ``iterserve``, ``vllm`` or ``sglang`` for every replica.
        api_key: the replicas' key (``--backend-api-key``), sent on polls.
        on_eject: called with a replica's name when it is ejected (metrics).
    """

    fetch: Fetch | None = None
    backend_type: str = "auto"
    poll_interval_s: float = 0.05
    poll_timeout_s: float = 0.4
    eject_after: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    api_key: str | None = None
    clock: Callable[[], float] = time.monotonic
    on_eject: Callable[[str], None] | None = None
    backends: dict[str, Backend] = field(default_factory=dict)

    def set_urls(self, urls: list[str]) -> None:
        """The replica set now (discovery's answer): new ones are added unready until their
        first poll, gone ones dropped."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self.backends):
            if url not in wanted:
                del self.backends[url]
        for url in wanted:
            if url not in self.backends:
                self.backends[url] = Backend(url, self.backend_type, ReplicaState(url, ready=False))

    def states(self) -> list[ReplicaState]:
        return [b.state for b in self.backends.values()]

    def ready(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.state.ready]

    # ----------------------------------------------------------------- in flight

    def begin_attempt(self, b: Backend) -> OpenAttempt:
        """A proxied request is being sent to ``b``: it counts in ``b.in_flight`` until
        :meth:`end_attempt`, and in ``b``'s score (``in_flight_since_report``) until then or
        until the replica's next report, which counts it itself."""
        b.in_flight += 1
        b.state.in_flight_since_report += 1
        return OpenAttempt(b, b.state.report)

    def end_attempt(self, attempt: OpenAttempt) -> None:
        """The request of ``attempt`` is over (answered, failed or abandoned). If no report
        came meanwhile it no longer loads the replica and no report will take it off; after a
        report, the poll has already reset the count from what is open."""
        b = attempt.backend
        b.in_flight -= 1
        if b.state.report is attempt.report:
            b.state.in_flight_since_report = max(0, b.state.in_flight_since_report - 1)

    # ----------------------------------------------------------------- polling

    async def run(self) -> None:
        """Poll every replica every interval, each on its own task (a slow replica does not
        delay the others' reports), forever (cancel to stop)."""
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for url, b in self.backends.items():
                    if url not in tasks or tasks[url].done():
                        tasks[url] = asyncio.create_task(self._poll_loop(b))
                for url in [u for u in tasks if u not in self.backends]:
                    tasks.pop(url).cancel()
                await asyncio.sleep(self.poll_interval_s)
        finally:
            for task in tasks.values():
                task.cancel()

    async def _poll_loop(self, b: Backend) -> None:
        while self.backends.get(b.url) is b:
            if not b.ejected or self.clock() >= b.next_probe_at:
                await self.poll(b)
            await asyncio.sleep(self.poll_interval_s)

    async def poll_all(self) -> None:
        """One poll of every replica that is due, at once (start-up, tests)."""
        now = self.clock()
        due = [b for b in self.backends.values() if not b.ejected or now >= b.next_probe_at]
        await asyncio.gather(*(self.poll(b) for b in due))

    async def poll(self, b: Backend) -> None:
        """One poll of ``b``; its report, readiness and failure count follow."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
            # that lands as the fetch completes, and the poll loop then never stops.
            async with asyncio.timeout(self.poll_timeout_s):
                report = await self._fetch(b, headers)
        except Exception as e:  # whatever a replica answers, only its own poll fails
            self.record_failure(b, f"poll: {type(e).__name__}: {e}")
            return
        b.state.report = report
        # Requests the router has open there that the report does not count yet (sent after
        # the replica took its numbers): a burst keeps counting until the replica sees it.
        b.state.in_flight_since_report = max(
            0, b.in_flight - report.num_running - report.num_waiting
        )
        b.polls_ok += 1
        self.record_success(b)
        if report.draining:  # answering, but refusing new work: no traffic, no failure
            b.state.ready = False

    async def _fetch(self, b: Backend, headers: dict[str, str]) -> Any:
        assert self.fetch is not None, "the pool polls through a fetch function"
        now = self.clock
        if b.kind == "iterserve":
            status, body = await self.fetch(b.url + "/load", headers)
            _check_status(status, "/load")
            return parse_iterserve_load(json.loads(body), now())
        if b.kind == "auto":
            # By shape, not status: vLLM answers GET /load too (200, {"server_load": N}).
            status, body = await self.fetch(b.url + "/load", headers)
            if status == 200:
                try:
                    report = parse_iterserve_load(json.loads(body), now())
                except ValueError:  # not JSON, or another server's /load: try /metrics
                    pass
                else:
                    b.kind = "iterserve"
                    return report
        status, body = await self.fetch(b.url + "/metrics", headers)
        _check_status(status, "/metrics")
        text = body.decode("utf-8", "replace")
        kind = b.kind if b.kind in ("vllm", "sglang") else detect_prometheus_type(text)
        if kind is None:
            raise LoadFormatError("neither /load nor vLLM / SGLang metrics")
        b.kind = kind
        return parse_prometheus_load(text, kind, now())

    # ----------------------------------------------------------------- health

    def record_failure(self, b: Backend, why: str, request: bool = False) -> None:
        """A failed poll, or (``request``) a proxied request that failed before its first
        byte. Polls and requests keep separate streaks: a replica whose ``/load`` answers
        while its generations hang is still ejected."""
        if request:
            b.request_failures += 1
        else:
            b.poll_failures += 1
        if b.ejected:
            b.backoff_s = min(self.max_backoff_s, b.backoff_s * 2)
            b.next_probe_at = self.clock() + b.backoff_s
            return
        failures = max(b.poll_failures, b.request_failures)
        if failures >= self.eject_after or b.polls_ok == 0:
            # Never seen well, or failing repeatedly: no traffic until a probe succeeds.
            b.state.ready = False
        if failures >= self.eject_after:
            b.ejected = True
            # Re-admitted by a good poll and failing its requests still (none good since): the
            # backoff doubles, so a replica whose /load answers while its generations fail is
            # not sent a request every backoff_s.
            again = b.request_failures > self.eject_after
            b.backoff_s = min(self.max_backoff_s, b.backoff_s * 2) if again else self.backoff_s
            b.next_probe_at = self.clock() + b.backoff_s
            logger.warning("replica %s ejected after %d failures (%s)", b.name, failures, why)
            if self.on_eject is not None:
                self.on_eject(b.name)

    def record_success_request(self, b: Backend) -> None:
        """A proxied request got its answer: the request failure streak ends."""
        b.request_failures = 0

    def record_success(self, b: Backend) -> None:
        """A good poll: the poll streak ends; an ejected replica (its probe came) is back.
        Its request streak stays until a request succeeds, so one more failure ejects it
        again, with a doubled backoff."""
        if b.ejected:
            logger.info("replica %s is back", b.name)
            b.ejected = False
        b.poll_failures = 0
        b.state.ready = True

    # ----------------------------------------------------------------- aggregates

    def aggregated_load(self) -> dict[str, Any]:
        """The router's ``/load`` (docs/router.md): block-weighted KV usage, summed queues."""
        ready = self.ready()
        reports = [b.state.report for b in ready if b.state.report is not None]
        blocks = sum(r.num_total_blocks for r in reports)
        if blocks:
            usage = sum(r.kv_cache_usage * r.num_total_blocks for r in reports) / blocks
        else:
            usage = sum(r.kv_cache_usage for r in reports) / len(reports) if reports else 0.0
        return {
            "kv_cache_usage": usage,
            "num_running": sum(r.num_running for r in reports),
            "num_waiting": sum(r.num_waiting for r in reports),
            "num_ready_replicas": len(ready),
            "num_replicas": len(self.backends),
        }


@contextlib.asynccontextmanager
async def polling(pool: ReplicaPool) -> Any:
    """Run ``pool``'s polling on a task for the duration of the block."""
    await pool.poll_all()
    task = asyncio.create_task(pool.run())
    try:
        yield pool
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _check_status(status: int, path: str) -> None:
    if status != 200:
        raise PollStatusError(f"{path} answered {status}")
