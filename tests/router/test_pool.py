"""The pool's in-flight accounting alone: every proxied attempt is bracketed by
``begin_attempt`` / ``end_attempt``, and a replica's report takes over what it counts."""

from __future__ import annotations

import asyncio
import json

from iterserve.router.pool import Backend, ReplicaPool

URL = "http://r:1"


def _pool(reports: list[dict[str, int]]) -> tuple[ReplicaPool, Backend]:
    """A pool of one replica whose polls answer ``reports`` in turn."""

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return 200, json.dumps({"kv_cache_usage": 0.0, **reports.pop(0)}).encode()

    pool = ReplicaPool(fetch, backend_type="iterserve")
    pool.set_urls([URL])
    return pool, pool.backends[URL]


def test_an_attempt_counts_until_it_ends() -> None:
    pool, b = _pool([])
    first = pool.begin_attempt(b)
    second = pool.begin_attempt(b)
    assert (b.in_flight, b.state.in_flight_since_report) == (2, 2)
    assert first.backend is b and first.report is None
    pool.end_attempt(first)
    assert (b.in_flight, b.state.in_flight_since_report) == (1, 1)
    pool.end_attempt(second)
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 0)


def test_a_report_takes_over_the_requests_it_counts() -> None:
    """A poll sets ``in_flight_since_report`` to the attempts the replica did not count yet;
    an attempt begun before that report then ends without taking anything off."""
    pool, b = _pool([
        {"num_running": 1, "num_waiting": 0},
        {"num_running": 0, "num_waiting": 0},
    ])  # fmt: skip
    early = [pool.begin_attempt(b) for _ in range(3)]
    asyncio.run(pool.poll(b))  # the replica runs one of the three
    assert (b.in_flight, b.state.in_flight_since_report) == (3, 2)
    late = pool.begin_attempt(b)  # after the report
    assert late.report is b.state.report
    assert b.state.in_flight_since_report == 3
    for attempt in early:  # their report is gone: the poll already counted them
        pool.end_attempt(attempt)
    assert (b.in_flight, b.state.in_flight_since_report) == (1, 3)
    pool.end_attempt(late)  # begun under this report: it no longer loads the replica
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 2)
    asyncio.run(pool.poll(b))  # nothing open, nothing running
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 0)


def test_the_count_since_the_report_never_goes_below_zero() -> None:
    pool, b = _pool([])
    attempt = pool.begin_attempt(b)
    b.state.in_flight_since_report = 0  # as a poll that saw the request leaves it
    pool.end_attempt(attempt)
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 0)
