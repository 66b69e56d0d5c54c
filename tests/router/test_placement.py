"""Prefix placement end to end: two routers over the same simulated replicas send each prefix to
the same replica (no per-process state decides placement); with KV events, a prompt goes where
its prefix's blocks are."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
from router_utils import all_idle, router, until
from server_utils import free_port, run_server, simulated_replicas
from sim_profiles import make_profile, write_profile

from iterserve.router.pool import replica_name
from iterserve.router.scoring import HashRing, prefix_key

PROFILE = make_profile(fixed_s=0.010)


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_profile(tmp_path_factory.mktemp("placement") / "profile.json", PROFILE)


def test_two_routers_send_each_prefix_to_the_same_replica(profile_file: Path) -> None:
    with simulated_replicas(profile_file, 4) as servers:
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
                        await until(lambda app=app: all_idle(app), "idle replicas reported")
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


def test_a_shared_prefix_goes_where_its_blocks_are_by_kv_events(profile_file: Path) -> None:
    """Replicas on 127.0.0.2-4 publish KV events on one port; the router subscribes. A long
    prompt served by one replica (sent to it directly) makes the next prompt with the same
    prefix go there through the router, though the hash would place it elsewhere."""
    events_port = free_port()
    flags = ("--simulate", str(profile_file), "--kv-events-port", str(events_port))
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(run_server(*flags, host=f"127.0.0.{i}")) for i in (2, 3, 4)]
        backends = [x for s in servers for x in ("--backend", s.url)]
        names = [replica_name(s.url) for s in servers]
        prefix = "You are a careful assistant. Answer in French. " * 12
        key = prefix_key(prefix + "first question")
        hashed = HashRing(sorted(names)).walk(key)[0]
        holder = next(s for s in servers if replica_name(s.url) != hashed)
        vocab = PROFILE.model.vocab_size

        async def run() -> None:
            router_flags = ("--kv-events-port", str(events_port), "--tokenizer", f"char:{vocab}")
            async with (
                router(*backends, *router_flags) as (url, app),
                httpx.AsyncClient(timeout=30) as http,
            ):
                index = app.proxy.picker.kv_index
                await until(lambda: all_idle(app), "replicas ready")
                # Each replica's events seen (a subscription misses what is published before
                # it reaches the replica), before the first request.
                for i, server in enumerate(servers):
                    name = replica_name(server.url)
                    for attempt in range(100):
                        warm = {"prompt": f"warm-up {i} {attempt} " + "z" * 80, "max_tokens": 1}
                        await http.post(server.url + "/v1/completions", json=warm)
                        with contextlib.suppress(AssertionError):
                            await until(lambda n=name: index.num_blocks(n) > 0, "", 0.2)
                            break
                    assert index.num_blocks(name) > 0, f"no KV events from {name}"
                body = {"prompt": prefix + "first question", "max_tokens": 2}
                r = await http.post(holder.url + "/v1/completions", json=body)
                assert r.status_code == 200
                name = replica_name(holder.url)
                await until(lambda: index.num_blocks(name) > 0, "the holder's blocks indexed")
                await until(lambda: all_idle(app), "idle again")
                body = {"prompt": prefix + "second question", "max_tokens": 2}
                r = await http.post(url + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-routed-to"] == holder.url
                metrics = (await http.get(url + "/metrics")).text
                assert 'iterserve_router_picks_total{policy="least_kv",reason="kv_match"} 1.0' in (
                    metrics
                )

        asyncio.run(run())
