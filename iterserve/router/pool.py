"""The router's replicas: their load reports, in-flight counts, ejection and probing back.

Every proxied attempt is bracketed by :meth:`ReplicaPool.begin_attempt` and
:meth:`~ReplicaPool.end_attempt`: the pool alone changes a replica's in-flight numbers.

Each replica is polled every ``poll_interval_s`` with a bounded timeout (iterserve: ``/load``;
vLLM and SGLang: ``/metrics``; see :mod:`iterserve.router.backends`). A replica is *ready*
while its last poll succeeded and it is not ejected. ``eject_after`` consecutive failures
(polls or proxied requests failing before their first byte) eject it; it is probed back after
a backoff that doubles on every failed probe (``backoff_s`` .. ``max_backoff_s``); one good
poll re-admits it.

A replica is known by its URL (where requests go) and its *name*: the pod name discovery
reports, or ``host:port`` for a ``--backend`` URL. The name is the replica's identity for
picking and its ``replica`` label in the metrics; a replica that leaves the set has its
series removed (``on_remove``) once its last open attempt ends, so pods replaced by a
rolling restart leave no series behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
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
    """One replica as the router tracks it (``name``: its pod name or ``host:port``)."""

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


def replica_name(url: str) -> str:
    """The name of a replica known by its URL alone (``--backend``): its ``host:port``."""
    return urllib.parse.urlsplit(url).netloc


@dataclass
class ReplicaPool:
    """The replicas behind the router (see the module docstring).

    Args:
        fetch: what polls go through (set before polling starts).
        backend_type: ``auto``, ``iterserve``, ``vllm`` or ``sglang`` for every replica.
        api_key: the replicas' key (``--backend-api-key``), sent on polls.
        on_eject: called with a replica's name when it is ejected (metrics).
        on_remove: called with a replica's name once it has left the set and its last open
            attempt has ended (its metric series go).
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
    on_remove: Callable[[str], None] | None = None
    backends: dict[str, Backend] = field(default_factory=dict)  # by URL
    _by_name: dict[str, Backend] = field(default_factory=dict, init=False, repr=False)
    # Gone from the set with attempts still open: their series go when the last one ends.
    _leaving: dict[str, Backend] = field(default_factory=dict, init=False, repr=False)
    # Set, then replaced by a fresh one, each time a replica turns ready (held requests).
    _turned_ready: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def set_urls(self, urls: Iterable[str]) -> None:
        """:meth:`set_replicas` for replicas known by URL alone, each named ``host:port``."""
        self.set_replicas({replica_name(url): url for url in urls})

    def set_replicas(self, replicas: Mapping[str, str]) -> None:
        """The replica set now (discovery's answer), ``name -> url``: new ones are added
        unready until their first poll, gone ones dropped (a name at a new URL is a new
        replica under the same name). A name that left is reported to ``on_remove`` at once,
        or when its last open attempt ends."""
        wanted = {url.rstrip("/"): name for name, url in replicas.items()}
        for url, b in list(self.backends.items()):
            if wanted.get(url) != b.name:
                del self.backends[url]
                if b.name not in replicas:
                    self._leave(b)
        for url, name in wanted.items():
            if url not in self.backends:
                self._leaving.pop(name, None)  # back before its last attempt ended
                state = ReplicaState(name, ready=False)
                self.backends[url] = Backend(url, self.backend_type, state)
        self._by_name = {b.name: b for b in self.backends.values()}

    def _leave(self, b: Backend) -> None:
        if b.in_flight:
            self._leaving[b.name] = b
        elif self.on_remove is not None:
            self.on_remove(b.name)

    def named(self, name: str) -> Backend:
        """The replica called ``name`` (a picked :class:`ReplicaState`'s name). Raises
        ``KeyError`` when none is."""
        return self._by_name[name]

    def present(self, b: Backend) -> bool:
        """Whether ``b`` is still in the set (not dropped by discovery)."""
        return self.backends.get(b.url) is b

    def states(self) -> list[ReplicaState]:
        return [b.state for b in self.backends.values()]

    def ready(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.state.ready]

    def turned_ready(self) -> Coroutine[Any, Any, bool]:
        """What to await for the next replica to turn ready (a poll re-admits it or finds
        it ready for the first time): what requests held for lack of one wait on. Bound to
        the next turn when called, so a turn between the call and the await is not missed."""
        return self._turned_ready.wait()

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
        if b.in_flight == 0 and self._leaving.get(b.name) is b:
            del self._leaving[b.name]
            if self.on_remove is not None:
                self.on_remove(b.name)

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
        while self.present(b):
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
        was_ready = b.state.ready
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
        if b.state.ready and not was_ready:
            turned, self._turned_ready = self._turned_ready, asyncio.Event()
            turned.set()

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
            if self.on_eject is not None and self.present(b):  # a gone one keeps no series
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

    def probe_soon(self) -> None:
        """Probe every ejected replica within ``backoff_s``, its doubled backoff cut short:
        while requests wait for a replica (scale from zero), the one coming up must not sit
        out a backoff of up to ``max_backoff_s`` first. The backoff itself is kept."""
        due = self.clock() + self.backoff_s
        for b in self.backends.values():
            if b.ejected and b.next_probe_at > due:
                b.next_probe_at = due

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
