"""A simulated replica publishes its prefix cache's changes as vLLM's KV events: the prompt's
full blocks with their tokens and parent chain, a shared prefix stored once, evictions under
KV pressure; and a port in use is a one-line start-up error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from kv_events_utils import BlockRemovedV, BlockStoredV, Collector
from server_utils import ITERSERVE, assert_kv_events_port_in_use_fails, free_port, run_server
from sim_profiles import make_profile, write_profile

from iterserve.kv_events import BlockRemoved, BlockStored, prompt_block_hashes

BS = 16
NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "profile.json"
    return write_profile(path, make_profile(fixed_s=0.002))


def complete(url: str, token_ids: list[int]) -> None:
    body = {"model": "Test-Model", "prompt": token_ids, "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def stored_hashes(events: list[Any]) -> set[int]:
    return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}


def removed_hashes(events: list[Any]) -> set[int]:
    return {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


def test_a_simulated_replica_publishes_stored_and_removed_blocks(
    profile_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAME", "sim-pod-0")
    kv_port = free_port()
    flags = ["--simulate", str(profile_file), "--kv-events-port", str(kv_port)]
    flags += ["--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BS)]
    with run_server(*flags, startup_timeout_s=30) as server:
        events = Collector(kv_port)
        try:
            # Warm-up prompts of one full block each (token ids 500 + i) until one is seen.
            events.sync(lambda i: complete(server.url, [500 + i] * (BS + 1)))

            # A: 2 full blocks and 8 tokens: one BlockStored of blocks 0-1, parent None.
            a = list(range(10, 10 + 2 * BS + 8))
            ha = prompt_block_hashes(a, BS)
            complete(server.url, a)
            events.until(lambda: set(ha) <= stored_hashes(events.events()))
            (a_stored,) = [e for e in events.events() if isinstance(e, BlockStored)]
            assert a_stored == BlockStored(tuple(ha), None, tuple(a[: 2 * BS]), BS, None, "GPU")

            # B shares A's 2 blocks (hits: not stored again) and adds a third, chained on A's.
            b = [*a[: 2 * BS], *range(300, 300 + BS), 7]
            hb = prompt_block_hashes(b, BS)
            assert hb[:2] == ha
            complete(server.url, b)
            events.until(lambda: hb[2] in stored_hashes(events.events()))
            b_stored = [e for e in events.events() if isinstance(e, BlockStored)][1:]
            assert b_stored == [BlockStored((hb[2],), ha[1], tuple(b[2 * BS : 3 * BS]), BS)]

            # KV pressure: prompts of 3 new blocks each on an 8-block pool evict A's and B's.
            fillers = [[600 + 60 * i + t for t in range(3 * BS + 1)] for i in range(4)]
            for filler in fillers:
                complete(server.url, filler)
            events.until(lambda: set(hb) <= removed_hashes(events.events()))
            got = events.events()
            # Everything removed had been stored (here, or by a warm-up prompt before the
            # subscription caught up); at most NUM_BLOCKS stay cached.
            warm_ups = {prompt_block_hashes([500 + i] * BS, BS)[0] for i in range(1000)}
            assert removed_hashes(got) <= stored_hashes(got) | warm_ups
            assert len(stored_hashes(got) - removed_hashes(got)) <= NUM_BLOCKS

            # The frames: one topic, consecutive sequence numbers, vLLM's decoder agrees.
            assert {m.topic for m in events.messages} == {"kv@sim-pod-0@Test-Model"}
            seqs = [m.seq for m in events.messages]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            vllm_events = [e for batch in events.vllm_batches for e in batch.events]
            assert len(vllm_events) == len(got)
            for ours, theirs in zip(got, vllm_events, strict=True):
                if isinstance(ours, BlockStored):
                    assert isinstance(theirs, BlockStoredV)
                    assert theirs.block_hashes == list(ours.block_hashes)
                    assert theirs.parent_block_hash == ours.parent_block_hash
                    assert theirs.token_ids == list(ours.token_ids)
                else:
                    assert isinstance(theirs, BlockRemovedV)
                    assert theirs.block_hashes == list(ours.block_hashes)
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            assert "\niterserve_kv_events_dropped_total 0.0\n" in metrics
        finally:
            events.close()


def test_a_kv_events_port_in_use_is_a_one_line_error(profile_file: Path) -> None:
    assert_kv_events_port_in_use_fails([*ITERSERVE, "serve", "--simulate", str(profile_file)])
