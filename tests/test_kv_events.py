"""The KV-events wire format: our encoder against vLLM's (msgspec structs declared as vLLM
declares them), our decoder on what vLLM's releases send, and malformed input."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import msgspec
import pytest
from kv_events_utils import (
    AllBlocksClearedV,
    BlockRemovedV,
    BlockStoredV,
    NewBlockStored,
    OldBlockRemoved,
    OldBlockStored,
    VllmEventBatch,
    VllmKVEventBatch,
    subscribe,
)

from iterserve import kv_events
from iterserve.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    KVEventsBindError,
    KVEventsFormatError,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    external_block_hash,
    hash_block_tokens,
    make_topic,
    parse_topic,
    prompt_block_hashes,
)

BATCH = EventBatch(
    ts=1700000000.25,
    events=(
        BlockStored((11, 2**64 - 1), None, tuple(range(8)), 4),
        BlockStored((13,), 2**64 - 1, (9, 9, 9, 9), 4, None, MEDIUM_GPU),
        BlockRemoved((11,)),
        AllBlocksCleared(),
    ),
)


def test_round_trip_is_exact() -> None:
    assert decode_batch(encode_batch(BATCH)) == BATCH
    frames = encode_message("kv@pod-0@default", 7, BATCH)
    msg = decode_message(frames)
    assert (msg.topic, msg.seq, msg.batch) == ("kv@pod-0@default", 7, BATCH)
    assert frames[1] == b"\x00" * 7 + b"\x07"  # 8-byte big-endian


def test_vllms_decoder_reads_our_payload() -> None:
    """Decoded as vLLM's subscriber example does (msgspec, its structs): same fields."""
    got = msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(encode_batch(BATCH))
    assert got.ts == BATCH.ts and got.data_parallel_rank is None
    assert got.events == [
        BlockStoredV([11, 2**64 - 1], None, list(range(8)), 4, None, "GPU"),
        BlockStoredV([13], 2**64 - 1, [9, 9, 9, 9], 4, None, "GPU"),
        BlockRemovedV([11], "GPU"),
        AllBlocksClearedV(),
    ]


def test_our_payload_is_the_array_layout_of_the_contract() -> None:
    raw = msgpack.unpackb(encode_batch(BATCH), raw=False)
    assert raw == [
        1700000000.25,
        [
            ["BlockStored", [11, 2**64 - 1], None, list(range(8)), 4, None, "GPU"],
            ["BlockStored", [13], 2**64 - 1, [9, 9, 9, 9], 4, None, "GPU"],
            ["BlockRemoved", [11], "GPU"],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_we_read_what_vllm_releases_send() -> None:
    enc = msgspec.msgpack.Encoder()
    current = VllmKVEventBatch(
        ts=1.5,
        events=[
            BlockStoredV([b"\x01" * 32], b"\x02" * 32, [1, 2], 2, 3, "CPU"),
            BlockRemovedV([5], None),
            AllBlocksClearedV(),
        ],
        data_parallel_rank=2,
    )
    assert decode_batch(enc.encode(current)) == EventBatch(
        1.5,
        (
            BlockStored((b"\x01" * 32,), b"\x02" * 32, (1, 2), 2, 3, "CPU"),
            BlockRemoved((5,), None),
            AllBlocksCleared(),
        ),
        2,
    )
    old = VllmEventBatch(
        ts=2.0, events=[OldBlockStored([1], None, [7, 8], 2, None), OldBlockRemoved([1])]
    )
    assert decode_batch(enc.encode(old)) == EventBatch(
        2.0, (BlockStored((1,), None, (7, 8), 2, None, None), BlockRemoved((1,), None))
    )
    new = VllmEventBatch(ts=3, events=[NewBlockStored([1], 4, [7], 1, None, "GPU", "x", [None], 0)])
    assert decode_batch(enc.encode(new)).events == (BlockStored((1,), 4, (7,), 1, None, "GPU"),)


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


STORED = ["BlockStored", [1], None, [1, 2], 2, None, "GPU"]


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"\xc1", "not msgpack"),
        (b"", "not msgpack"),
        (_pack({"ts": 1}), "must be an array"),
        (_pack([1.0]), "must be an array"),
        (_pack(["now", []]), "ts must be a number"),
        (_pack([True, []]), "ts must be a number"),
        (_pack([1.0, {}]), "events must be an array"),
        (_pack([1.0, [], "rank"]), "data_parallel_rank must be int or nil"),
        (_pack([1.0, [["Nope"]]]), "unknown event tag 'Nope'"),
        (_pack([1.0, [[]]]), "starting with its tag"),
        (_pack([1.0, [7]]), "starting with its tag"),
        (_pack([1.0, [STORED[:5]]]), "at least 5 fields"),
        (
            _pack([1.0, [["BlockStored", 1, None, [1, 2], 2, None]]]),
            "block_hashes must be an array",
        ),
        (_pack([1.0, [["BlockStored", [1.5], None, [1, 2], 2, None]]]), "int or bytes"),
        (_pack([1.0, [["BlockStored", [True], None, [1, 2], 2, None]]]), "int or bytes"),
        (_pack([1.0, [["BlockStored", [1], "p", [1, 2], 2, None]]]), "parent_block_hash"),
        (_pack([1.0, [["BlockStored", [1], None, [1, -2], 2, None]]]), "non-negative ints"),
        (_pack([1.0, [["BlockStored", [1], None, [1, "a"], 2, None]]]), "non-negative ints"),
        # Past int64 the chain hash cannot pack it (it killed the router's subscription).
        (_pack([1.0, [["BlockStored", [1], None, [1, 1 << 63], 2, None]]]), "below 2\\*\\*63"),
        (_pack([1.0, [["BlockStored", [1], None, [1, 2], 0, None]]]), "block_size must be"),
        (
            _pack([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]]),
            "3 token ids for 1 blocks",
        ),
        (_pack([1.0, [["BlockStored", [1], None, [1, 2], 2, "lora"]]]), "lora_id must be int"),
        (_pack([1.0, [["BlockStored", [1], None, [1, 2], 2, None, 5]]]), "medium must be str"),
        (_pack([1.0, [["BlockRemoved"]]]), "needs its block_hashes"),
        (_pack([1.0, [["BlockRemoved", [None]]]]), "int or bytes"),
        (_pack([1.0, [["BlockRemoved", [1], 3]]]), "medium must be str"),
    ],
)
def test_malformed_payloads_are_rejected_with_what_was_wrong(payload: bytes, error: str) -> None:
    with pytest.raises(KVEventsFormatError, match=error):
        decode_batch(payload)


def test_malformed_frames_are_rejected() -> None:
    good = encode_message("kv@p@m", 0, BATCH)
    with pytest.raises(KVEventsFormatError, match="3 frames, got 2"):
        decode_message(good[:2])
    with pytest.raises(KVEventsFormatError, match="8 bytes, got 4"):
        decode_message([good[0], b"\x00" * 4, good[2]])
    with pytest.raises(KVEventsFormatError, match="not utf-8"):
        decode_message([b"\xff\xfe", good[1], good[2]])
    with pytest.raises(ValueError, match="outside"):
        encode_message("kv@p@m", -1, BATCH)


def test_topic() -> None:
    assert make_topic("pod-1", "org/model@v2") == "kv@pod-1@org/model@v2"
    assert parse_topic("kv@pod-1@org/model@v2") == ("pod-1", "org/model@v2")
    for bad in ("kv@pod", "xx@pod@m", "kv@@m", "kv@pod@"):
        with pytest.raises(KVEventsFormatError, match="is not 'kv@<pod>@<model>'"):
            parse_topic(bad)
    with pytest.raises(ValueError, match="must not contain '@'"):
        make_topic("a@b", "m")
    with pytest.raises(ValueError, match="needs a pod and a model"):
        make_topic("", "m")


def test_prompt_block_hashes_chain_the_block_pools_hashes() -> None:
    tokens = list(range(10))
    h0 = hash_block_tokens(None, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    assert prompt_block_hashes(tokens, 4) == [external_block_hash(h0), external_block_hash(h1)]
    assert external_block_hash(h0) == int.from_bytes(h0[:8], "big") < 2**64
    assert prompt_block_hashes(tokens[:3], 4) == []
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        prompt_block_hashes(tokens, 0)


# --- the publisher ---------------------------------------------------------------------------


def recv(sock: Any, timeout_s: float = 5.0) -> Any:
    assert sock.poll(int(timeout_s * 1000)), "no KV-events message arrived"
    return decode_message(sock.recv_multipart())


def test_publisher_numbers_batches_and_subscribers_decode_them() -> None:
    pub = KVEventPublisher(0, make_topic("pod-a", "m"), host="127.0.0.1")
    sub = subscribe(pub.port)
    try:
        # A SUB joins asynchronously: publish probes until one arrives, then check the rest.
        while not sub.poll(20):
            pub.publish([AllBlocksCleared()])
        first = recv(sub)
        assert first.topic == "kv@pod-a@m" and first.batch.events == (AllBlocksCleared(),)
        while sub.poll(50):  # the probes still in flight
            first = recv(sub)
        stored = BlockStored((1, 2), None, (5, 6, 7, 8), 2)
        assert pub.publish([stored, BlockRemoved((1,))])
        msg = recv(sub)
        assert msg.seq == first.seq + 1
        assert msg.batch.events == (stored, BlockRemoved((1,)))
        assert abs(msg.batch.ts - time.time()) < 5 and msg.batch.data_parallel_rank is None
        assert pub.num_dropped_batches == 0
    finally:
        sub.close()
        pub.close()
    assert not pub._thread.is_alive()
    assert not pub.publish([AllBlocksCleared()])  # closed: dropped, nothing raised
    pub.close()  # idempotent


def test_a_port_in_use_is_a_clear_error() -> None:
    pub = KVEventPublisher(0, "kv@p@m", host="127.0.0.1")
    try:
        with pytest.raises(KVEventsBindError, match=rf"tcp://127.0.0.1:{pub.port}: Address"):
            KVEventPublisher(pub.port, "kv@p@m", host="127.0.0.1")
    finally:
        pub.close()
    with pytest.raises(ValueError, match="port must be in"):
        KVEventPublisher(70000, "kv@p@m")


def test_a_full_queue_drops_batches_leaving_a_gap_in_the_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """publish never waits: with the sender stuck on a batch, batches past the queue's bound
    are dropped and counted, and the kept ones keep their numbers (a subscriber sees the gap)."""
    sending = threading.Event()
    release = threading.Event()
    sent: list[int] = []

    def stuck_encode(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
        sending.set()
        release.wait(5)
        sent.append(seq)
        return encode_message(topic, seq, batch)

    monkeypatch.setattr(kv_events, "encode_message", stuck_encode)
    pub = KVEventPublisher(0, "kv@p@m", host="127.0.0.1", max_queue_batches=2)
    try:
        assert pub.publish([AllBlocksCleared()])
        assert sending.wait(5)  # the sender holds batch 0
        results = [pub.publish([AllBlocksCleared()]) for _ in range(5)]
        assert results == [True, True, False, False, False]
        assert pub.num_dropped_batches == 3
    finally:
        release.set()
        pub.close()
    assert sent == [0, 1, 2]
    assert pub.publish([AllBlocksCleared()]) is False  # closed
