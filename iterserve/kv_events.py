"""KV-cache events in vLLM's wire format: what a replica's prefix cache holds, as it changes.

A replica publishes, once per engine iteration that changed its prefix cache, one
:class:`EventBatch` on a ZMQ PUB socket; a router (ours, or llm-d's precise-prefix scorer)
subscribes to every replica and keeps, per replica, the set of block hashes it holds. The
format is vLLM's (``vllm/distributed/kv_events.py``), so consumers written for vLLM read
iterserve replicas unchanged. This module is torch-free and engine-free: the server's engine
encodes with it and the router decodes with it.

Message: a ZMQ multipart of three frames::

    [topic, seq, payload]
     |      |    +-- msgpack EventBatch (below)
     |      +------- 8-byte big-endian unsigned sequence number, +1 per batch from 0
     +-------------- utf-8 "kv@<pod>@<model>"

Payload: msgspec's encoding of vLLM's structs (``array_like=True``: a struct is an array of
its fields in order; events are ``tag=True``: the class name comes first)::

    EventBatch       = [ts, [event, ...], data_parallel_rank]     ts: unix seconds (float)
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids,
                        block_size, lora_id, medium]
    BlockRemoved     = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

``BlockStored`` covers ``len(block_hashes)`` consecutive full blocks of one prefix chain:
``token_ids`` holds their ``len(block_hashes) * block_size`` tokens in order, and
``parent_block_hash`` is the hash of the block before the first (``None`` at a prompt's
start). Hashes are the block pool's chain hashes (which identify the whole prefix up to and
including the block), sent as unsigned 64-bit ints.

Decision: hashes are ints, not bytes. vLLM's ``ExternalBlockHash`` is ``bytes | int``; ints
are what its older releases, llm-d's indexer and Dynamo's relay all read, and 64 bits keep
collisions negligible for any cache size. The decoder still accepts bytes hashes (from a vLLM
that sends them) and hands them on as bytes.

Decision: the decoder reads vLLM's releases both before and after they added fields: it
needs ``BlockStored``'s first five fields (``medium`` arrived later) and ``BlockRemoved``'s
first, and ignores trailing fields it does not know (newer vLLMs append ``lora_name``,
``extra_keys``, ``group_idx``...). Anything else malformed raises :class:`KVEventsFormatError`
with what was wrong: the router feeds this module bytes off the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# msgpack and zmq are imported where they are used: the engine imports this module for the
# events and the chain hash, and a machine that never publishes (the lent GPU machine's
# benchmark image) need not have them.

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # blocks in the accelerator's KV cache (vLLM's name for it)
MEDIUM_CPU = "CPU"  # blocks in host memory (our swap pool)

BlockHash = int | bytes
"""A block's chain hash: iterserve sends unsigned 64-bit ints; a vLLM may send bytes."""

_SEQ_NUM_BYTES = 8
_UINT64_MAX = (1 << 64) - 1
_TOKEN_ID_END = 1 << 63  # token ids are hashed as int64 (hash_block_tokens)
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
"""Larger payloads are refused before unpacking (one iteration's events are kilobytes)."""


class KVEventsFormatError(ValueError):
    """A message or payload that is not a well-formed KV-events batch; says what was wrong."""


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one prefix chain became cached (reusable by a later prompt).

    Fields (in wire order):
        block_hashes: one chain hash per block, in prefix order.
        parent_block_hash: the hash of the block before ``block_hashes[0]``; ``None`` when the
            first block starts the sequence.
        token_ids: the blocks' tokens, ``len(block_hashes) * block_size`` of them, in order.
        block_size: tokens per block.
        lora_id: the LoRA adapter's id; iterserve serves no adapters, so always ``None``.
        medium: where the blocks live, :data:`MEDIUM_GPU` or :data:`MEDIUM_CPU`.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted from ``medium``: a later prompt can no longer reuse them there."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica forgot its whole prefix cache (the block pool's ``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one engine iteration, in the order they happened.

    ``ts`` is the wall-clock time of publication (unix seconds); ``data_parallel_rank`` is
    ``None`` (iterserve replicas are one data-parallel rank each).
    """

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class KVEventsMessage:
    """One received message: the decoded frames of ``[topic, seq, payload]``."""

    topic: str
    seq: int
    batch: EventBatch


# --- block hashes ----------------------------------------------------------------------------


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chain hash of one full block: sha256(parent hash || token ids as int64), 16 bytes.

    Chaining makes a block's hash identify the whole prefix up to and including it. The block
    pool keys its prefix cache by it; it lives here so that a router computes, from a prompt's
    token ids, exactly the hashes the replicas publish.
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()[:16]


def external_block_hash(block_hash: bytes) -> int:
    """The published form of a chain hash: its first 8 bytes as a big-endian unsigned int."""
    return int.from_bytes(block_hash[:8], "big")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The published hashes of the full blocks of ``token_ids``, in order (a partial last
    block has none). Raises ValueError when ``block_size < 1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        out.append(external_block_hash(parent))
    return out


# --- topic -----------------------------------------------------------------------------------


def default_pod_name() -> str:
    """The pod part of the topic: env ``POD_NAME`` (the operator's downward API), else the host."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def make_topic(pod: str, model: str) -> str:
    """``kv@<pod>@<model>`` (llm-d's convention). Raises ValueError on an empty part or ``@``
    in the pod name (the model name may contain ``@``: the topic splits at the first two)."""
    if not pod or not model:
        raise ValueError(f"topic needs a pod and a model name, got pod={pod!r} model={model!r}")
    if "@" in pod:
        raise ValueError(f"pod name {pod!r} must not contain '@'")
    return f"kv@{pod}@{model}"


def parse_topic(topic: str) -> tuple[str, str]:
    """``kv@<pod>@<model>`` -> ``(pod, model)``. Raises KVEventsFormatError otherwise."""
    parts = topic.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        raise KVEventsFormatError(f"topic {topic!r} is not 'kv@<pod>@<model>'")
    return parts[1], parts[2]


# --- encoding --------------------------------------------------------------------------------


def _event_to_wire(event: KVCacheEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch`` (the third frame of a message)."""
    import msgpack

    wire = [batch.ts, [_event_to_wire(e) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(wire, use_bin_type=True)


def encode_message(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
    """The three frames ``[topic, seq, payload]``; ``seq`` in ``[0, 2**64)``."""
    if not 0 <= seq <= _UINT64_MAX:
        raise ValueError(f"sequence number {seq} is outside [0, 2**64)")
    return [topic.encode(), seq.to_bytes(_SEQ_NUM_BYTES, "big"), encode_batch(batch)]


# --- decoding --------------------------------------------------------------------------------


def _check_hash(value: object, what: str) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise KVEventsFormatError(f"{what} must be an int or bytes, got {value!r}")
    return value


def _check_int_list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise KVEventsFormatError(f"{what} must be an array, got {type(value).__name__}")
    return value


def _check_optional(value: object, kind: type, what: str) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise KVEventsFormatError(f"{what} must be {kind.__name__} or nil, got {value!r}")


def _decode_block_stored(fields: list[Any]) -> BlockStored:
    if len(fields) < 5:
        raise KVEventsFormatError(f"BlockStored needs at least 5 fields, got {len(fields)}")
    hashes_raw, parent_raw, tokens_raw, block_size, lora_id = fields[:5]
    hashes = tuple(
        _check_hash(h, "BlockStored.block_hashes[]")
        for h in _check_int_list(hashes_raw, "BlockStored.block_hashes")
    )
    parent = (
        None if parent_raw is None else _check_hash(parent_raw, "BlockStored.parent_block_hash")
    )
    tokens = _check_int_list(tokens_raw, "BlockStored.token_ids")
    # Below 2**63: the chain hash packs token ids as int64 (a larger one raised past here).
    if any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _TOKEN_ID_END for t in tokens
    ):
        raise KVEventsFormatError("BlockStored.token_ids must be non-negative ints below 2**63")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KVEventsFormatError(f"BlockStored.block_size must be an int >= 1, got {block_size!r}")
    if len(tokens) != len(hashes) * block_size:
        raise KVEventsFormatError(
            f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {block_size}"
        )
    medium = _check_optional(fields[5] if len(fields) > 5 else None, str, "BlockStored.medium")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_check_optional(lora_id, int, "BlockStored.lora_id"),
        medium=medium,
    )


def _decode_event(raw: object) -> KVCacheEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise KVEventsFormatError(f"an event must be an array starting with its tag, got {raw!r}")
    tag, fields = raw[0], raw[1:]
    if tag == "BlockStored":
        return _decode_block_stored(fields)
    if tag == "BlockRemoved":
        if not fields:
            raise KVEventsFormatError("BlockRemoved needs its block_hashes")
        hashes = _check_int_list(fields[0], "BlockRemoved.block_hashes")
        medium = _check_optional(fields[1] if len(fields) > 1 else None, str, "BlockRemoved.medium")
        return BlockRemoved(
            tuple(_check_hash(h, "BlockRemoved.block_hashes[]") for h in hashes), medium
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventsFormatError(f"unknown event tag {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """Parse a msgpack payload into an :class:`EventBatch`.

    Raises:
        KVEventsFormatError: not msgpack, larger than :data:`MAX_PAYLOAD_BYTES`, or not the
            shape above (the message says which field).
    """
    import msgpack

    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVEventsFormatError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise KVEventsFormatError(f"payload is not msgpack: {e}") from e
    if not isinstance(raw, list) or len(raw) < 2:
        raise KVEventsFormatError(f"an EventBatch must be an array [ts, events, ...], got {raw!r}")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventsFormatError(f"EventBatch.ts must be a number, got {ts!r}")
    if not isinstance(events, list):
        raise KVEventsFormatError(f"EventBatch.events must be an array, got {events!r}")
    rank = _check_optional(raw[2] if len(raw) > 2 else None, int, "EventBatch.data_parallel_rank")
    return EventBatch(float(ts), tuple(_decode_event(e) for e in events), rank)


def decode_message(frames: Sequence[bytes]) -> KVEventsMessage:
    """Parse the frames of one ZMQ multipart message ``[topic, seq, payload]``.

    Raises:
        KVEventsFormatError: not three frames, a topic that is not utf-8, a sequence number
            that is not 8 bytes, or a bad payload (:func:`decode_batch`).
    """
    if len(frames) != 3:
        raise KVEventsFormatError(f"a KV-events message has 3 frames, got {len(frames)}")
    topic_raw, seq_raw, payload = (bytes(f) for f in frames)
    try:
        topic = topic_raw.decode()
    except UnicodeDecodeError as e:
        raise KVEventsFormatError(f"topic is not utf-8: {topic_raw!r}") from e
    if len(seq_raw) != _SEQ_NUM_BYTES:
        raise KVEventsFormatError(f"sequence number must be 8 bytes, got {len(seq_raw)}")
    return KVEventsMessage(topic, int.from_bytes(seq_raw, "big"), decode_batch(payload))


# --- publishing ------------------------------------------------------------------------------


class KVEventsBindError(RuntimeError):
    """The publisher's port cannot be bound (in use, or not an address of this host)."""


@dataclass(frozen=True)
class KVEventsConfig:
    """Where a replica publishes (picklable: it travels to the engine process).

    Attributes:
        port: TCP port (``--kv-events-port``; 0 binds a free one, for tests).
        topic: :func:`make_topic` of the pod and the served model.
        host: address to bind.
    """

    port: int
    topic: str
    host: str = "0.0.0.0"

    def open(self) -> KVEventPublisher:
        """Bind and start the publisher. Raises KVEventsBindError."""
        return KVEventPublisher(self.port, self.topic, self.host)


class KVEventPublisher:
    """A ZMQ PUB socket bound on ``tcp://host:port`` that publishes one batch per call.

    :meth:`publish` never blocks the engine: it numbers the batch and puts it on a bounded
    queue; a daemon thread encodes and sends. A full queue drops the batch (counted in
    :attr:`num_dropped_batches`) and its number is skipped, so a subscriber sees the gap.
    Past the PUB socket's high-water mark ZMQ itself drops messages to a slow subscriber
    (unseen here; the subscriber sees the gap the same way). There is no replay socket: a
    subscriber that lost batches, or that sees the sequence start again at 0 (a restarted
    replica), should forget what it knew of this replica and rebuild from the stream.

    Args:
        port: TCP port to bind; 0 binds a free one (read it from :attr:`port`).
        topic: the first frame of every message (:func:`make_topic`).
        host: address to bind (``0.0.0.0``: every interface, as vLLM's ``tcp://*:5557``).
        max_queue_batches: batches waiting for the sender thread before new ones are dropped.
        sndhwm: ZMQ send high-water mark, in messages per subscriber.

    Raises:
        KVEventsBindError: the address cannot be bound.
    """

    def __init__(
        self,
        port: int,
        topic: str,
        host: str = "0.0.0.0",
        max_queue_batches: int = 10_000,
        sndhwm: int = 100_000,
    ) -> None:
        import zmq

        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        self.topic = topic
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.LINGER, 100)  # ms the last batches get at close
        address = f"tcp://{host}:{port if port else '*'}"
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise KVEventsBindError(
                f"cannot publish KV events on {address}: {e} (--kv-events-port: choose "
                "another port, or 0 for no events; an iterserve router subscribes to one "
                "port on every replica's host, so replicas on one machine each take their "
                "own --host: 127.0.0.2, 127.0.0.3, ...)"
            ) from e
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://0.0.0.0:5557
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.num_dropped_batches = 0
        self._next_seq = 0
        self._queue: queue.Queue[tuple[int, EventBatch]] = queue.Queue(max_queue_batches)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="iterserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> bool:
        """Queue one batch (stamped now); False when it was dropped (queue full, or closed).

        Call from one thread (the engine loop's): sequence numbers are assigned here.
        """
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if self._stop.is_set():
            return False
        try:
            self._queue.put_nowait((seq, EventBatch(time.time(), tuple(events))))
        except queue.Full:
            self.num_dropped_batches += 1
            if self.num_dropped_batches == 1 or self.num_dropped_batches % 1000 == 0:
                logger.warning(
                    "KV events: %d batches dropped (the sender thread falls behind)",
                    self.num_dropped_batches,
                )
            return False
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the thread, close the socket.
        Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            # Still inside a send: a ZMQ socket is not thread-safe, so it is left to the
            # process's exit rather than closed under the sender.
            logger.warning("KV events: the sender thread did not stop in %.1f s", timeout_s)
            return
        self._sock.close()
        self._ctx.term()

    def _run(self) -> None:
        import zmq

        while True:
            try:
                seq, batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                self._sock.send_multipart(encode_message(self.topic, seq, batch), zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped_batches += 1
            except zmq.ZMQError:
                logger.exception("KV events: sending batch %d failed", seq)
