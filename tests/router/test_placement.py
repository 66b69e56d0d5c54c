"""Prefix placement end to end: two routers over the same simulated replicas send each prefix to
the same replica (no per-process state decides placement)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_utils import pool_of, router, until
from server_utils import Server, run_server
from sim_profiles import make_profile, write_profile

PROFILE = make_profile(fixed_s=0.010)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_profile(tmp_path_factory.mktemp("placement") / "profile.json", PROFILE)


@contextlib.contextmanager
def replicas(profile_file: Path, n: int, *flags: str) -> Iterator[list[Server]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(run_server("--simulate", str(profile_file), *flags))
            for _ in range(n)
        ]


def _idle(app: object) -> bool:
    """Every replica ready, reported idle, nothing of this router's in flight."""
    states = [b.state for b in pool_of(app).backends.values()]
    return all(
        s.ready and s.report and s.report.num_running + s.report.num_waiting == 0 and s.load == 0
        for s in states
    )


def test_two_routers_send_each_prefix_to_the_same_replica(profile_file: Path) -> None:
    with replicas(profile_file, 4) as servers:
        backends = [x for s in servers for x in ("--backend", s.url)]

        async def run() -> None:
            async with (
                router(*backends) as (url_a, app_a),
                router(*backends) as (url_b, app_b),
                httpx.AsyncClient(timeout=30) as http,
            ):
                placed: dict[int, set[str]] = {}
                for i in range(24):  # 8 prefixes, 3 times each, alternately through A and B
                    p = i % 8
                    for url, app in ((url_a, app_a), (url_b, app_b)):
                        await until(lambda app=app: _idle(app), "idle replicas reported")
                        body = {
                            "prompt": f"system prompt {p}: " + "be kind. " * 80,
                            "max_tokens": 2,
                        }
                        r = await http.post(url + "/v1/completions", json=body)
                        assert r.status_code == 200
                        placed.setdefault(p, set()).add(r.headers["x-routed-to"])
                assert all(len(where) == 1 for where in placed.values()), placed
                # The ring spreads 8 prefixes over more than one replica.
                assert len(set().union(*placed.values())) > 1

        asyncio.run(run())
