"""KV-events test helpers: vLLM's own structs (an independent decoder, as vLLM's subscriber
example declares them) and a ZMQ subscriber that collects a replica's events."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from iterserve.kv_events import KVEventsMessage, decode_message

# vLLM's structs, declared as its kv_events.py (0.10/0.11) and its subscriber example.


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemovedV(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksClearedV(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]


# An older vLLM (0.9): no medium, no data_parallel_rank.
class OldBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


# A newer vLLM: fields appended after medium.
class NewBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


def subscribe(port: int, host: str = "127.0.0.1") -> zmq.Socket[bytes]:
    """A SUB socket on ``tcp://host:port`` taking every ``kv@`` topic."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sock.connect(f"tcp://{host}:{port}")
    return sock


class Collector:
    """Everything one replica published since :meth:`sync`, decoded twice: by
    :mod:`iterserve.kv_events` and by vLLM's msgspec structs."""

    def __init__(self, port: int) -> None:
        self.sock = subscribe(port)
        self.messages: list[KVEventsMessage] = []
        self.vllm_batches: list[VllmKVEventBatch] = []
        self._vllm = msgspec.msgpack.Decoder(type=VllmKVEventBatch)

    def sync(self, poke: Callable[[int], None], timeout_s: float = 30.0) -> None:
        """A SUB joins asynchronously: call ``poke(i)`` (a request that stores a new block)
        until its events arrive, then drop what arrived."""
        deadline = time.monotonic() + timeout_s
        i = 0
        while not self.sock.poll(200):
            assert time.monotonic() < deadline, "no KV-events message arrived"
            poke(i)
            i += 1
        while self.sock.poll(300):
            self.sock.recv_multipart()

    def until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Receive until ``done()`` (checked after each message) or fail at the timeout."""
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"timed out; received {self.messages}"
            if self.sock.poll(int(min(remaining, 1.0) * 1000)):
                frames = self.sock.recv_multipart()
                self.messages.append(decode_message(frames))
                self.vllm_batches.append(self._vllm.decode(frames[2]))

    def events(self) -> list[Any]:
        return [e for m in self.messages for e in m.batch.events]

    def close(self) -> None:
        self.sock.close()
