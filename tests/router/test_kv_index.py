"""The router's KV index on hand-made event batches, and the picker that uses it: blocks keyed
by the router's own chain hash of their tokens (the engine's hashes here are arbitrary
numbers), chains, removals, clears, sequence gaps, malformed messages; the index's counters
and blocks on the router's ``/metrics``."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    encode_message,
)
from iterserve.router.app import RouterApp
from iterserve.router.cli_args import add_router_args
from iterserve.router.kv_index import KvIndex, chain_keys
from iterserve.router.prompt_tokens import load_prompt_tokenizer, prompt_token_ids
from iterserve.router.scoring import HashRing, LoadReport, Picker, ReplicaState, prefix_key
from iterserve.router.server import build
from iterserve.sim.tokenizer import CharTokenizer

BS = 4
PROMPT = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens


def _frames(seq: int, *events: KVCacheEvent) -> list[bytes]:
    return encode_message("kv@pod@model", seq, EventBatch(0.0, tuple(events)))


def _stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU"
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, None, medium)


def _holding_three_blocks() -> KvIndex:
    index = KvIndex()
    # Two events of one chain: blocks 0-1 from the start, then block 2 under block 1.
    assert index.apply_frames("a", _frames(0, _stored([901, 902], None, PROMPT[:8])))
    assert index.apply_frames("a", _frames(1, _stored([903], 902, PROMPT[8:12])))
    return index


def test_stored_chains_match_a_prompts_leading_blocks() -> None:
    index = _holding_three_blocks()
    assert index.matched_blocks(PROMPT, ["a", "b"]) == {"a": 3, "b": 0}
    other_second_block = [*PROMPT[:4], 7, 7, 7, 7, *PROMPT[8:]]
    assert index.matched_blocks(other_second_block, ["a"]) == {"a": 1}
    assert index.matched_blocks(PROMPT[:7], ["a"]) == {"a": 1}  # one full block
    # Same tokens at another position are another block (the key chains the prefix).
    assert index.matched_blocks(PROMPT[4:], ["a"]) == {"a": 0}
    assert index.num_blocks("a") == 3 and index.num_blocks() == 3
    assert index.replicas["a"].held.keys() == set(chain_keys(PROMPT, BS))


def test_removed_blocks_and_all_cleared() -> None:
    index = _holding_three_blocks()
    index.apply_frames("a", _frames(2, BlockRemoved((902,), "GPU")))
    assert index.matched_blocks(PROMPT, ["a"]) == {"a": 1}  # the run stops at the hole
    index.apply_frames("a", _frames(3, BlockRemoved((12345,), "GPU")))  # unknown: no harm
    assert index.num_blocks("a") == 2
    index.apply_frames("a", _frames(4, AllBlocksCleared()))
    assert index.matched_blocks(PROMPT, ["a"]) == {"a": 0}
    # Cleared, then stored again from the start: found again.
    index.apply_frames("a", _frames(5, _stored([1, 2, 3], None, PROMPT[:12])))
    assert index.matched_blocks(PROMPT, ["a"]) == {"a": 3}


def test_a_sequence_gap_or_restart_clears_the_replica() -> None:
    index = _holding_three_blocks()
    index.apply_frames("a", _frames(3, _stored([950], None, [1, 2, 3, 4])))  # 2 was lost
    assert index.counters.gaps == 1
    assert index.matched_blocks(PROMPT, ["a"]) == {"a": 0}
    assert index.num_blocks("a") == 1  # the gap's own batch is applied after the clear
    index.apply_frames("a", _frames(0, _stored([1], None, PROMPT[:4])))  # restarted at 0
    assert index.counters.gaps == 2 and index.matched_blocks(PROMPT, ["a"]) == {"a": 1}
    # A subscription that reconnects starts the sequence afresh: no gap counted.
    index.clear("a")
    index.apply_frames("a", _frames(17, _stored([2], None, PROMPT[:4])))
    assert index.counters.gaps == 2 and index.num_blocks("a") == 1


def test_malformed_messages_are_ignored_and_counted() -> None:
    index = _holding_three_blocks()
    good = _frames(2, AllBlocksCleared())
    bad = [
        good[:2],  # two frames
        [good[0], b"\x00" * 4, good[2]],  # a short sequence number
        [good[0], good[1], b"\xc1 not msgpack"],
        [good[0], good[1], b"\x93\x00\x91\x92\xabBlockStored\x01\xc0"],  # a short BlockStored
        # A token id past int64 (a rogue publisher): the chain hash cannot pack it.
        _frames(2, BlockStored((904,), 903, (1 << 63, 1, 2, 3), BS)),
    ]
    for frames in bad:
        assert not index.apply_frames("a", frames)
    assert index.counters.malformed == len(bad)
    assert index.matched_blocks(PROMPT, ["a"]) == {"a": 3}  # nothing changed
    assert index.replicas["a"].last_seq == 1


def test_unknown_parents_and_other_media_hold_nothing() -> None:
    index = KvIndex()
    index.apply_frames("a", _frames(0, _stored([5, 6], 999, PROMPT[4:12])))  # parent unseen
    assert index.counters.unresolved == 2 and index.num_blocks("a") == 0
    index.apply_frames("a", _frames(1, _stored([7], None, PROMPT[:4], medium="CPU")))
    assert index.num_blocks("a") == 0  # swapped out: not reusable without a swap-in
    index.apply_frames("a", _frames(2, _stored([7], None, PROMPT[:4])))
    index.apply_frames("a", _frames(3, BlockRemoved((7,), "CPU")))
    assert index.num_blocks("a") == 1


def test_a_replica_holding_too_many_blocks_is_cleared() -> None:
    index = KvIndex(max_blocks_per_replica=2)
    index.apply_frames("a", _frames(0, _stored([1, 2, 3], None, PROMPT[:12])))
    assert index.counters.overflows == 1 and index.num_blocks("a") == 0


def _replicas(*names: str, running: int = 0) -> list[ReplicaState]:
    return [ReplicaState(n, LoadReport(0.0, 0, running, 100, 0.0)) for n in names]


def test_the_picker_sends_a_prompt_to_the_replica_holding_its_blocks() -> None:
    key = prefix_key("the prompt's text")
    walk = HashRing("abcd").walk(key)
    holder, other = walk[3], walk[2]  # the last two the hash would pick
    index = KvIndex()
    index.apply_frames(holder, _frames(0, _stored([1, 2], None, PROMPT[:8])))
    index.apply_frames(other, _frames(0, _stored([3], None, PROMPT[:4])))
    pickers = [Picker(seed=s, kv_index=index) for s in (1, 2)]
    for picker in pickers:
        replicas = _replicas(*"abcd")
        pick = picker.pick(replicas, 0.0, key, prompt_token_ids=PROMPT)
        assert (pick.replica.name, pick.reason) == (holder, "kv_match")
        # Over the bound (ceil(1.25 * (16 + 1) / 4) = 6): the next longest match.
        next(r for r in replicas if r.name == holder).in_flight_since_report = 16
        pick = picker.pick(replicas, 0.0, key, prompt_token_ids=PROMPT)
        assert (pick.replica.name, pick.reason) == (other, "kv_match")
        # No replica under the bound holds the first block: the hash placement.
        pick = picker.pick(replicas, 0.0, key, prompt_token_ids=[5] * 12)
        assert (pick.replica.name, pick.reason) == (walk[0], "prefix")
    # Without tokens (or an empty index) the picker asks for none.
    assert pickers[0].prompt_tokens({"prompt": "x"}) is None  # no tokenizer given
    tokenizing = Picker(kv_index=KvIndex(), tokenize=lambda body: [1, 2, 3])
    assert tokenizing.prompt_tokens({"prompt": "x"}) is None  # nothing held anywhere
    tokenizing.kv_index = index
    assert tokenizing.prompt_tokens({"prompt": "x"}) == [1, 2, 3]
    assert tokenizing.prompt_tokens(None) is None


def test_prompt_token_ids_as_the_server_counts_them() -> None:
    tok = CharTokenizer(1000)
    assert prompt_token_ids(tok, {"prompt": "abcdefgh"}) == tok("abcdefgh").input_ids
    assert prompt_token_ids(tok, {"prompt": ["abcd", "efgh"]}) == tok("abcd").input_ids
    assert prompt_token_ids(tok, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    text = "system: Be brief.\nuser: hi there\nassistant:"
    assert prompt_token_ids(tok, {"messages": messages}) == tok(text).input_ids
    no_prompt = {"messages": messages, "add_generation_prompt": False}
    assert prompt_token_ids(tok, no_prompt) == tok(text.removesuffix("assistant:")).input_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for body in ({"messages": image}, {"prompt": 5}, {}, {"messages": [{"content": "x"}]}):
        assert prompt_token_ids(tok, body) is None


def test_load_prompt_tokenizer(tmp_path: Path) -> None:
    assert load_prompt_tokenizer("char").vocab_size == 49152
    assert load_prompt_tokenizer("char:500").vocab_size == 500
    for bad in ("char:x", "char:2", str(tmp_path), str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="--tokenizer"):
            load_prompt_tokenizer(bad)
    other = tmp_path / "vocab.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json or its directory"):
        load_prompt_tokenizer(str(other))
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot read it"):
        load_prompt_tokenizer(str(tmp_path / "tokenizer.json"))


def test_kv_event_flags_are_checked() -> None:
    from iterserve.router.config import RouterConfig

    backend = ("http://127.0.0.1:8000",)
    with pytest.raises(ValueError, match="--tokenizer is for --kv-events-port"):
        RouterConfig(backend=backend, tokenizer="char")
    with pytest.raises(ValueError, match=r"--kv-events-port must be in \[0, 65535\]"):
        RouterConfig(backend=backend, kv_events_port=70000)
    assert RouterConfig(backend=backend, kv_events_port=5557, tokenizer="char").kv_events_port


def _router_with_kv_events() -> RouterApp:
    """The router's app from its flags, with ``--kv-events-port`` (nothing started: the
    subscriptions run in the lifespan, which these tests do not enter)."""
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    backends = ["--backend", "http://127.0.0.2:8000", "--backend", "http://127.0.0.3:8000"]
    return build(parser.parse_args([*backends, "--kv-events-port", "5557", "--tokenizer", "char"]))


def _kv_samples(app: RouterApp) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's ``/metrics``, its ``iterserve_router_kv_*`` samples: (name, labels) ->
    value."""

    async def scrape() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.get("/metrics")
            assert r.status_code == 200
            return r.text

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(asyncio.run(scrape()))
        for s in family.samples
        if s.name.startswith("iterserve_router_kv_")
    }


def test_the_index_counters_and_blocks_are_router_metrics() -> None:
    app = _router_with_kv_events()
    index = app.proxy.picker.kv_index
    assert index is not None
    zero = {
        ("iterserve_router_kv_batches_total", ()): 0.0,
        ("iterserve_router_kv_events_total", (("type", "AllBlocksCleared"),)): 0.0,
        ("iterserve_router_kv_events_total", (("type", "BlockRemoved"),)): 0.0,
        ("iterserve_router_kv_events_total", (("type", "BlockStored"),)): 0.0,
        ("iterserve_router_kv_malformed_total", ()): 0.0,
        ("iterserve_router_kv_gaps_total", ()): 0.0,
        ("iterserve_router_kv_unresolved_blocks_total", ()): 0.0,
        ("iterserve_router_kv_overflows_total", ()): 0.0,
    }
    assert _kv_samples(app) == zero  # every counter from the start, no replica yet

    a, b = "127.0.0.2:8000", "127.0.0.3:8000"  # the replicas' names (host:port)
    index.apply_frames(a, _frames(0, _stored([901, 902], None, PROMPT[:8])))
    index.apply_frames(
        a, _frames(1, _stored([903], 902, PROMPT[8:12]), BlockRemoved((901,), "GPU"))
    )
    index.apply_frames(b, _frames(0, _stored([5, 6], 999, PROMPT[4:12])))  # parent unseen
    index.apply_frames(b, _frames(3, _stored([7], None, PROMPT[:4])))  # 1 and 2 lost: a gap
    index.apply_frames(b, [b"kv@pod@model", b"\x00"])  # malformed
    index.apply_frames(b, _frames(4, AllBlocksCleared()))
    index.apply_frames(b, _frames(5, _stored([8], None, PROMPT[:4])))
    samples = _kv_samples(app)
    assert samples == {
        **zero,
        ("iterserve_router_kv_batches_total", ()): 6.0,
        ("iterserve_router_kv_events_total", (("type", "AllBlocksCleared"),)): 1.0,
        ("iterserve_router_kv_events_total", (("type", "BlockRemoved"),)): 1.0,
        ("iterserve_router_kv_events_total", (("type", "BlockStored"),)): 5.0,
        ("iterserve_router_kv_malformed_total", ()): 1.0,
        ("iterserve_router_kv_gaps_total", ()): 1.0,
        ("iterserve_router_kv_unresolved_blocks_total", ()): 2.0,
        ("iterserve_router_kv_blocks", (("replica", a),)): 2.0,  # 902, 903 (901 removed)
        ("iterserve_router_kv_blocks", (("replica", b),)): 1.0,
    }

    index.remove(a)  # it left the set (the subscriptions drop it): its series goes too
    samples = _kv_samples(app)
    assert ("iterserve_router_kv_blocks", (("replica", a),)) not in samples
    assert samples[("iterserve_router_kv_blocks", (("replica", b),))] == 1.0
    assert samples[("iterserve_router_kv_batches_total", ())] == 6.0


def test_no_kv_metrics_without_kv_events() -> None:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    app = build(parser.parse_args(["--backend", "http://127.0.0.2:8000"]))
    assert app.proxy.picker.kv_index is None
    assert _kv_samples(app) == {}
