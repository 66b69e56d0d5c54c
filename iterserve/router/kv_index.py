"""Which prompt blocks each replica holds, from the KV-cache events it publishes.

The replicas publish vLLM's KV events (:mod:`iterserve.kv_events`): ``BlockStored`` with the
blocks' own hashes, their parent's hash and their token ids; ``BlockRemoved`` with hashes;
``AllBlocksCleared``. The index keeps, per replica, the set of blocks it holds in its
accelerator's KV cache, keyed by the router's *own* chain hash of the token ids: a prompt's
blocks are then looked up from its tokens alone, whatever hash the replica uses (iterserve's
and vLLM's differ, and vLLM's is seeded per process). Per replica::

    engine hash --(keys)--> router key      (so that parents and removals resolve)
    router key  --(held)--> how many of the replica's engine hashes map to it

    router key of block i = hash_block_tokens(router key of block i-1, its block_size tokens)

A ``BlockStored`` whose parent the index never saw cannot be keyed (its prefix is unknown):
its blocks are skipped and counted (``unresolved``); they resolve when the chain is stored
again from its start. Blocks stored in another medium than the accelerator's (``CPU``: the
swap pool) are not held: a prompt cannot reuse them without a swap-in.

Sequence numbers: each replica's batches are numbered +1 from 0. A gap (batches lost: a slow
subscriber past the publisher's high-water mark, or a batch the publisher dropped) or a
number that goes back (the replica restarted) clears that replica's blocks, and the index
rebuilds from the stream as blocks are stored again (vLLM's replay socket is not
implemented; a block stored before the gap and still cached is unknown until re-stored, so
the router under-counts, never over-counts, until then). A subscription that reconnects
clears the replica too (:mod:`iterserve.router.kv_subscriber`), and a replica that leaves
the set is dropped. A malformed message is ignored and counted (``malformed``): the bytes
come off the network.

Bounded: a replica holding more than ``max_blocks_per_replica`` blocks (a publisher that
never removes) is cleared and counted as an overflow.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from iterserve.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsFormatError,
    decode_message,
    hash_block_tokens,
)

logger = logging.getLogger("iterserve.router")

MAX_BLOCKS_PER_REPLICA = 1 << 20  # ~150 MB of index per replica at most


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The router keys of the full blocks of ``token_ids``, in order (a partial last block has
    none). Raises ValueError when ``block_size < 1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class ReplicaBlocks:
    """One replica's blocks as its events told them (see the module docstring)."""

    block_size: int | None = None  # from its BlockStored events
    last_seq: int | None = None
    keys: dict[BlockHash, bytes] = field(default_factory=dict)  # engine hash -> router key
    held: dict[bytes, int] = field(default_factory=dict)  # router key -> engine hashes

    def clear(self) -> None:
        self.keys.clear()
        self.held.clear()


@dataclass
class IndexCounters:
    """What the index has seen, all replicas (the router's ``iterserve_router_kv_*`` metrics,
    :class:`~iterserve.router.metrics.KvIndexCollector`)."""

    batches: int = 0  # batches applied
    events: dict[str, int] = field(default_factory=dict)  # events applied, by type name
    malformed: int = 0  # messages that did not decode
    gaps: int = 0  # sequence gaps or restarts that cleared a replica
    unresolved: int = 0  # stored blocks whose parent was unknown
    overflows: int = 0  # replicas cleared for holding too many blocks


class KvIndex:
    """Per replica name, the blocks it holds (see the module docstring).

    Args:
        max_blocks_per_replica: past this a replica's blocks are cleared (an overflow).
    """

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self.replicas: dict[str, ReplicaBlocks] = {}
        self.counters = IndexCounters()

    # ----------------------------------------------------------------- updates

    def apply_frames(self, name: str, frames: Sequence[bytes]) -> bool:
        """One ZMQ message ``[topic, seq, payload]`` from replica ``name``; False (and
        counted) when it does not decode, in which case nothing changes."""
        try:
            message = decode_message(frames)
        except KVEventsFormatError as e:
            self.counters.malformed += 1
            if self.counters.malformed == 1 or self.counters.malformed % 1000 == 0:
                logger.warning("KV events from %s: malformed message ignored (%s)", name, e)
            return False
        self.apply(name, message.seq, message.batch)
        return True

    def apply(self, name: str, seq: int, batch: EventBatch) -> None:
        """Batch number ``seq`` of replica ``name``: a gap first clears the replica."""
        replica = self.replicas.setdefault(name, ReplicaBlocks())
        if replica.last_seq is not None and seq != replica.last_seq + 1:
            self.counters.gaps += 1
            logger.info(
                "KV events from %s: batch %d after %d; its blocks are rebuilt from the stream",
                name,
                seq,
                replica.last_seq,
            )
            replica.clear()
        replica.last_seq = seq
        self.counters.batches += 1
        for event in batch.events:
            kind = type(event).__name__
            self.counters.events[kind] = self.counters.events.get(kind, 0) + 1
            if isinstance(event, BlockStored):
                self._stored(replica, event)
            elif isinstance(event, BlockRemoved):
                self._removed(replica, event)
            elif isinstance(event, AllBlocksCleared):
                replica.clear()
        if len(replica.keys) > self.max_blocks_per_replica:
            self.counters.overflows += 1
            logger.warning("KV events from %s: over %d blocks; cleared", name, len(replica.keys))
            replica.clear()

    def _stored(self, replica: ReplicaBlocks, event: BlockStored) -> None:
        if event.medium not in (None, MEDIUM_GPU):
            return
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent = replica.keys.get(event.parent_block_hash)
            if parent is None:
                self.counters.unresolved += len(event.block_hashes)
                return
        replica.block_size = event.block_size
        bs = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            parent = hash_block_tokens(parent, event.token_ids[i * bs : (i + 1) * bs])
            if engine_hash in replica.keys:
                continue  # stored twice without a removal: held once
            replica.keys[engine_hash] = parent
            replica.held[parent] = replica.held.get(parent, 0) + 1

    def _removed(self, replica: ReplicaBlocks, event: BlockRemoved) -> None:
        if event.medium not in (None, MEDIUM_GPU):
            return
        for engine_hash in event.block_hashes:
            key = replica.keys.pop(engine_hash, None)
            if key is None:
                continue
            count = replica.held[key] - 1
            if count:
                replica.held[key] = count
            else:
                del replica.held[key]

    def clear(self, name: str) -> None:
        """Forget what replica ``name`` holds, and its sequence (its subscription reconnected:
        the next batch starts afresh)."""
        replica = self.replicas.get(name)
        if replica is not None:
            replica.clear()
            replica.last_seq = None

    def remove(self, name: str) -> None:
        """Replica ``name`` left the set."""
        self.replicas.pop(name, None)

    # ----------------------------------------------------------------- queries

    def num_blocks(self, name: str | None = None) -> int:
        """Blocks held by replica ``name``, or by all replicas."""
        if name is not None:
            replica = self.replicas.get(name)
            return len(replica.held) if replica else 0
        return sum(len(r.held) for r in self.replicas.values())

    def matched_blocks(self, token_ids: Sequence[int], names: Iterable[str]) -> dict[str, int]:
        """For each replica of ``names``, how many of the prompt's leading full blocks it
        holds (0 for a replica the index knows nothing of). ``token_ids`` are the prompt's
        tokens as the replicas count them."""
        names = list(names)
        keys_by_size: dict[int, list[bytes]] = {}
        out: dict[str, int] = {}
        for name in names:
            replica = self.replicas.get(name)
            if replica is None or replica.block_size is None or not replica.held:
                out[name] = 0
                continue
            keys = keys_by_size.get(replica.block_size)
            if keys is None:
                keys = keys_by_size[replica.block_size] = chain_keys(token_ids, replica.block_size)
            out[name] = _leading(keys, replica.held)
        return out


def _leading(keys: Sequence[bytes], held: Mapping[bytes, int]) -> int:
    num = 0
    for key in keys:
        if key not in held:
            break
        num += 1
    return num
