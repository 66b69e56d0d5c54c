"""Scoring and picking, without HTTP: what the router and the simulator's replay share."""

from __future__ import annotations

from collections import Counter

import pytest

from iterserve.router.scoring import (
    HashRing,
    LoadReport,
    NoReplicaError,
    Picker,
    ReplicaState,
    ScoreWeights,
    prefix_key,
    scores,
)


def _replica(name: str, kv: float = 0.0, waiting: int = 0, running: int = 0, at: float = 0.0,
             in_flight: int = 0) -> ReplicaState:  # fmt: skip
    return ReplicaState(name, LoadReport(kv, waiting, running, 100, at), in_flight)


def test_scores_weigh_kv_usage_and_the_normalised_queue() -> None:
    a, b, c = _replica("a", kv=0.5, waiting=4), _replica("b", kv=0.2, waiting=2), _replica("c")
    c.in_flight_since_report = 2
    s = scores([a, b, c], now=0.1)
    # norm = max(4 + 0, 2 + 0, 0 + 2) = 4
    assert s == pytest.approx({"a": 0.5 + 1.0, "b": 0.2 + 0.5, "c": 0.5})
    s = scores([a, b, c], now=0.1, weights=ScoreWeights(kv=2.0, waiting=0.0, in_flight=1.0))
    assert s == pytest.approx({"a": 1.0, "b": 0.4, "c": 0.5})


def test_a_stale_or_missing_report_scores_as_saturated() -> None:
    fresh, stale = _replica("fresh", kv=0.9, waiting=9, at=10.0), _replica("stale", at=9.0)
    never = ReplicaState("never")
    s = scores([fresh, stale, never], now=10.2, stale_after_s=0.5)
    assert s["stale"] == s["never"] == 3.0
    assert s["fresh"] == pytest.approx(0.9 + 1.0)
    picker = Picker(prefix_affinity=False, seed=0)
    assert picker.pick([fresh, stale, never], now=10.2).replica is fresh


def test_a_burst_spreads_over_idle_replicas() -> None:
    replicas = [_replica(n) for n in "abcd"]
    picker = Picker(prefix_affinity=False, seed=1)
    picked = []
    for _ in range(8):
        r = picker.pick(replicas, now=0.0).replica
        r.in_flight_since_report += 1  # what the router does until the next report
        picked.append(r.name)
    assert Counter(picked) == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_least_kv_prefers_the_emptier_replica() -> None:
    busy, idle = _replica("busy", kv=0.8, waiting=5, running=20), _replica("idle", kv=0.1)
    picker = Picker(prefix_affinity=False, seed=0)
    assert {picker.pick([busy, idle], now=0.0).replica.name for _ in range(20)} == {"idle"}


def test_a_prefix_goes_to_the_lower_scored_of_its_first_two_replicas_on_the_ring() -> None:
    replicas = [_replica(n, running=2) for n in "abcd"]
    by_name = {r.name: r for r in replicas}
    picker = Picker(seed=0)
    key = prefix_key("You are a helpful assistant. " * 40)
    home, second, third = HashRing("abcd").walk(key)[:3]
    # Equal scores: ring order decides, every time (no random tie-break).
    picks = [picker.pick(replicas, 0.0, key) for _ in range(5)]
    assert {(p.replica.name, p.reason) for p in picks} == {(home, "prefix")}
    # The home busier than the second choice: the second takes it.
    by_name[home].in_flight_since_report = 1
    assert (
        picker.pick(replicas, 0.0, key).replica.name,
        picker.pick(replicas, 0.0, key).reason,
    ) == (second, "prefix_second")
    # The home over the bound (ceil(1.25 * (8 + 30 + 1) / 4) = 13): the next two on the ring.
    by_name[home].in_flight_since_report = 30
    by_name[second].in_flight_since_report = 1
    moved = picker.pick(replicas, 0.0, key)
    assert (moved.replica.name, moved.reason) == (third, "prefix_passed_on")


def test_two_pickers_place_every_prefix_alike_whatever_they_placed_before() -> None:
    """No per-process state decides placement: a router that has routed other traffic and a
    fresh one, given the same replicas and loads, send each prefix to the same replica."""
    import random

    rng = random.Random(0)
    loads = {n: (rng.random(), rng.randint(0, 3), rng.randint(0, 6)) for n in "abcdef"}

    def fleet() -> list[ReplicaState]:
        return [_replica(n, kv=kv, waiting=w, running=r) for n, (kv, w, r) in loads.items()]

    keys = [prefix_key(f"system prompt {i % 7}: " + "x" * 600 + str(i)) for i in range(60)]
    seasoned, fresh = Picker(seed=1), Picker(seed=2)
    scratch = fleet()
    for i in range(200):  # the same prefixes and others before, under other loads
        key = keys[i % 60] if i % 2 else f"other prompt {i}".encode()
        seasoned.pick(scratch, 0.0, key).replica.in_flight_since_report += 1
    a, b = fleet(), fleet()
    for key in keys:
        pa, pb = seasoned.pick(a, 0.0, key), fresh.pick(b, 0.0, key)
        assert (pa.replica.name, pa.reason) == (pb.replica.name, pb.reason)
        pa.replica.in_flight_since_report += 1
        pb.replica.in_flight_since_report += 1


def test_unshared_prompts_balance_nearly_as_without_affinity() -> None:
    for trial in range(3):
        replicas = [_replica(n) for n in "abcd"]
        picker = Picker(seed=3)
        for i in range(40):
            r = picker.pick(replicas, 0.0, f"unique prompt {trial} {i}".encode()).replica
            r.in_flight_since_report += 1
        assert all(9 <= r.in_flight_since_report <= 11 for r in replicas)


def test_the_ring_moves_only_the_keys_of_a_removed_replica() -> None:
    keys = [f"k{i}".encode() for i in range(500)]
    before = HashRing(["a", "b", "c", "d"])
    after = HashRing(["a", "b", "c"])
    moved = [k for k in keys if before.walk(k)[0] != after.walk(k)[0]]
    assert moved and all(before.walk(k)[0] == "d" for k in moved)
    assert sorted(before.walk(b"x")) == ["a", "b", "c", "d"]


def test_prefix_key_of_chat_and_completions() -> None:
    long = "x" * 2000
    assert prefix_key(long) == b"x" * 512
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    assert prefix_key(messages=messages) == b"system:Be brief.\nuser:first"
    assert prefix_key(messages=[*messages[:2], {"role": "user", "content": "other"}]) == (
        prefix_key(messages=messages)
    )


def test_prefix_key_of_token_ids_and_of_a_batch() -> None:
    """A prompt of token ids is keyed by its leading ids (it had no key: no affinity at all);
    a batch by its first prompt; what no replica takes has none."""
    from iterserve.router.decide import _prefix_key

    ids = list(range(1000))
    assert _prefix_key({"prompt": ids}) == prefix_key(token_ids=ids)
    assert _prefix_key({"prompt": ids}) == _prefix_key({"prompt": [*ids, 7]})  # same prefix
    assert _prefix_key({"prompt": [5, 6]}) == b"ids:5,6" != _prefix_key({"prompt": "5,6"})
    assert _prefix_key({"prompt": [ids, [1]]}) == _prefix_key({"prompt": ids})
    assert _prefix_key({"prompt": ["one", "two"]}) == b"one"
    for prompt in ([], [True, 1], [1.5], [{}], None, {}):
        assert _prefix_key({"prompt": prompt}) is None


def test_round_robin_random_and_session() -> None:
    replicas = [_replica(n) for n in "abc"]
    rr = Picker("round_robin")
    assert [rr.pick(replicas, 0.0).replica.name for _ in range(6)] == list("abcabc")
    a = [Picker("random", seed=5).pick(replicas, 0.0).replica.name for _ in range(3)]
    assert a == [Picker("random", seed=5).pick(replicas, 0.0).replica.name for _ in range(3)]
    session = Picker("session", seed=0)
    first = session.pick(replicas, 0.0, session="user-42")
    assert first.reason == "session"
    assert {session.pick(replicas, 0.0, session="user-42").replica.name for _ in range(5)} == {
        first.replica.name
    }
    assert session.pick(replicas, 0.0).reason == "no_session"


def test_no_ready_replica_and_bad_settings() -> None:
    down = _replica("a")
    down.ready = False
    with pytest.raises(NoReplicaError):
        Picker().pick([down], 0.0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        Picker("fastest")
    with pytest.raises(ValueError, match="load_bound"):
        Picker(load_bound=0.5)


def test_a_replica_answering_nonsense_fails_only_its_own_poll() -> None:
    import asyncio
    import contextlib
    import json

    from iterserve.router.backends import LoadFormatError, parse_iterserve_load
    from iterserve.router.pool import ReplicaPool

    for bad in ({"kv_cache_usage": 0, "num_waiting": 1e999, "num_running": 0},
                {"kv_cache_usage": 2.0, "num_waiting": 0, "num_running": 0},
                {"kv_cache_usage": 0.1, "num_waiting": -5, "num_running": 0}):  # fmt: skip
        with pytest.raises(LoadFormatError):
            parse_iterserve_load(bad, 0.0)

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        if url.startswith("http://draining"):
            load = {"kv_cache_usage": 0, "num_waiting": 0, "num_running": 1, "draining": True}
            return 200, json.dumps(load).encode()
        if url.startswith("http://bad"):
            return 200, b'{"kv_cache_usage": 0, "num_waiting": 1e999, "num_running": 0}'
        return 200, b'{"kv_cache_usage": 0.25, "num_waiting": 1, "num_running": 2}'

    async def run() -> None:
        pool = ReplicaPool(fetch, poll_interval_s=0.01, eject_after=2)
        pool.set_urls(["http://good:1", "http://bad:1", "http://draining:1"])
        task = asyncio.create_task(pool.run())
        await asyncio.sleep(0.2)
        good, bad = pool.backends["http://good:1"], pool.backends["http://bad:1"]
        polls = good.polls_ok
        await asyncio.sleep(0.1)
        assert good.polls_ok > polls and good.state.ready  # polling goes on
        assert bad.ejected and not bad.state.ready
        draining = pool.backends["http://draining:1"]
        assert not draining.state.ready and not draining.ejected  # no traffic, no failure
        task.cancel()  # stops, even with fetches that complete at once
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(run())
