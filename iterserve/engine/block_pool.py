"""The pool of KV blocks: reference counts, the free queue (which is also the LRU of cached
blocks) and the prefix-cache hash map.

A block is in exactly one of three states:

- **free**: ``ref_cnt == 0``, no hash; in the free queue.
- **cached**: ``ref_cnt == 0``, holds a full block of a reusable prefix (has a hash); in the
  free queue, so it counts as free and is evicted when the queue reaches it.
- **used**: ``ref_cnt > 0``; owned by one or more requests; not in the free queue.

Allocation pops from the head of the free queue; freed blocks go to its tail, so the least
recently freed cached block is evicted first (as vLLM v1's ``FreeKVCacheBlockQueue``).

KV-cache events (:mod:`iterserve.kv_events`, off until :meth:`BlockPool.enable_kv_events`):
the pool records ``BlockRemoved`` when an allocation evicts cached blocks and
``AllBlocksCleared`` on :meth:`~BlockPool.reset_prefix_cache`; the KV-cache manager records
``BlockStored`` (it knows the tokens and the parent). The engine loop takes them once per
iteration (:meth:`~BlockPool.take_events`, as vLLM's ``take_events``) and publishes them.
A block that is freed but keeps its hash is still cached: no event until it is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The chain hash is shared with the router (which computes a prompt's hashes as replicas do).
from iterserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    external_block_hash,
    hash_block_tokens,
)

__all__ = ["BlockPool", "KVBlock", "hash_block_tokens"]


@dataclass(eq=False)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """``num_blocks`` KV blocks with ids ``0 .. num_blocks - 1``.

    Raises:
        ValueError: from :meth:`allocate` when fewer blocks are free than asked for.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[bytes, KVBlock] = {}
        self._num_cached_free = 0  # cached blocks with ref_cnt 0
        # This iteration's KV-cache events, in order; None: not recorded.
        self.kv_events: list[KVCacheEvent] | None = None

    def enable_kv_events(self) -> None:
        """Record KV-cache events from now on (take them with :meth:`take_events`)."""
        if self.kv_events is None:
            self.kv_events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (empty when not recording)."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Free + cached blocks (all of which can be allocated)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks: no owner, hold a reusable prefix, evictable."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """``kv_cache_usage`` = 1 - num_free_blocks / num_blocks, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Block ids in free-queue order (next to be allocated first)."""
        return list(self._free_queue)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free_queue)} free")
        out = []
        evicted: list[int] = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(external_block_hash(block.block_hash))
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(tuple(evicted)))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to prefix-cache hits, taking unowned ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
                self._num_cached_free -= 1
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; unowned blocks go to the free queue's tail.

        Pass a request's blocks last-first: its tail blocks are the least likely to be shared,
        so they should be evicted first.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a used, full block under its chain hash (first writer wins); True when
        the prefix became cached by this call (the caller records ``BlockStored``)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False  # another block already holds this prefix; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay where they are)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._num_cached_free = 0
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None
        self._num_cached_free -= 1

    def check_integrity(self, owners: Iterable[Sequence[KVBlock]]) -> None:
        """Assert the pool's invariants; ``owners`` are the block tables of all requests.

        free + used = total; every ref count equals the number of tables holding the block;
        a block is in the free queue iff unowned; the hash map and the blocks agree.
        """
        refs = [0] * self.num_blocks
        for table in owners:
            for block in table:
                refs[block.block_id] += 1
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs[block.block_id]} owners"
            )
            assert (block.block_id in self._free_queue) == (block.ref_cnt == 0), block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_used + self.num_free_blocks == self.num_blocks
        assert len(self._cached) == sum(1 for b in self.blocks if b.block_hash is not None)
        cached_free = sum(1 for b in self._free_queue.values() if b.block_hash is not None)
        assert cached_free == self._num_cached_free
