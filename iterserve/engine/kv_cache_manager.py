"""Per-request block tables over the block pool, with prefix caching.

A request's block table covers its tokens in order: token ``i`` lives in block
``table[i // block_size]`` at offset ``i % block_size`` (its slot is
``block_id * block_size + offset``)::

    tokens:  [t0 .. t15 | t16 .. t31 | t32 t33 _ _ ...]   block_size = 16
    table:   [   7      |    2       |     9          ]
    slot(t33) = 9 * 16 + 1
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from iterserve.engine.request import Request
from iterserve.kv_events import BlockStored, external_block_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table; nobody else changes the pool.

    Args:
        num_blocks: blocks in the pool (exactly; no hidden reserved block).
        block_size: tokens per block.
        enable_caching: prefix caching by chain hashes of full blocks.
        watermark: fraction of all blocks kept free when admitting a new request.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Host (swap) pool: plain free list, no caching. Swapped request -> host block ids.
        self.num_host_blocks = num_host_blocks
        self._free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_tables: dict[str, list[int]] = {}
        self.set_watermark(watermark)
        self._tables: dict[str, list[KVBlock]] = {}
        # Per request: how many of its leading blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def set_watermark(self, watermark: float) -> None:
        """Keep ``watermark`` of all blocks free at admission (live settings)."""
        self.num_watermark_blocks = int(watermark * self.num_blocks)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_free_blocks_needed(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> int:
        """Free blocks :meth:`allocate_slots` would take for the same arguments (new blocks,
        plus prefix-cache hits nobody owns, which sit in the free queue); the watermark not
        included."""
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(table) - len(new_computed_blocks))
        return num_new_blocks + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def num_blocks_freed_by(self, request_ids: Sequence[str], keep: Sequence[KVBlock] = ()) -> int:
        """Blocks that would return to the free queue if these requests gave theirs back: those
        no other request holds (prefix sharing), less the ``keep`` blocks (another request's
        prefix-cache hits: freed, then taken again, they free nothing)."""
        holders: dict[int, int] = {}
        blocks: dict[int, KVBlock] = {}
        for request_id in request_ids:
            for block in self._tables.get(request_id, ()):
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
                blocks[block.block_id] = block
        kept = {b.block_id for b in keep}
        return sum(
            1
            for block_id, n in holders.items()
            if blocks[block_id].ref_cnt == n and block_id not in kept
        )

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(
                hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs])
            )

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        At least one token is always left to compute (its logits are needed to sample), so a
        hit never covers the last token.
        """
        if not self.enable_caching:
            return []
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        use_watermark: bool = False,
    ) -> bool:
        """Grow the request's table to hold ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` (prefix-cache hits of a request being admitted) are prepended
        to its table. Returns False, changing nothing, when the pool cannot supply the blocks
        (keeping the watermark free if ``use_watermark``).
        """
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(table) - len(new_computed_blocks))
        # Hits that nobody owns sit in the free queue: taking them shrinks what is free.
        needed = self.num_free_blocks_needed(request, num_new_tokens, new_computed_blocks)
        reserve = self.num_watermark_blocks if use_watermark else 0
        if needed + reserve > self.pool.num_free_blocks:
            return False
        self.pool.touch(new_computed_blocks)
        table = table + list(new_computed_blocks) + self.pool.allocate(num_new_blocks)
        self._tables[request.request_id] = table
        if new_computed_blocks:
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        table = self._tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        newly_cached = [
            i
            for i in range(start, num_full)
            if self.pool.cache_block(table[i], request.block_hashes[i])
        ]
        self._num_cached_blocks[request.request_id] = num_full
        if newly_cached and self.pool.kv_events is not None:
            self._record_stored(request, newly_cached)

    def _record_stored(self, request: Request, block_idxs: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks of the request (a
        block whose prefix another block already held breaks the run: it is not stored)."""
        assert self.pool.kv_events is not None
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        run_start = 0
        for k in range(1, len(block_idxs) + 1):
            if k < len(block_idxs) and block_idxs[k] == block_idxs[k - 1] + 1:
                continue
            first, last = block_idxs[run_start], block_idxs[k - 1]
            self.pool.kv_events.append(
                BlockStored(
                    block_hashes=tuple(external_block_hash(h) for h in hashes[first : last + 1]),
                    parent_block_hash=external_block_hash(hashes[first - 1]) if first else None,
                    token_ids=tuple(tokens[first * bs : (last + 1) * bs]),
                    block_size=bs,
                )
            )
            run_start = k

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (tail first, so its tail is evicted first)."""
        table = self._tables.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(table))

    # ----------------------------------------------------------------- swap

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_blocks_for(request.num_computed_tokens) <= len(self._free_host_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's computed blocks to the host pool; free its device blocks.

        Returns the copies to make, ``(device_block_id, host_block_id)`` pairs; the runner
        makes them before this iteration's forward reuses any freed block.
        """
        table = self._tables[request.request_id]
        num_blocks = self.num_blocks_for(request.num_computed_tokens)
        host = [self._free_host_blocks.pop() for _ in range(num_blocks)]
        self._host_tables[request.request_id] = host
        copies = [(table[i].block_id, host[i]) for i in range(num_blocks)]
        self.free(request)
        return copies

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for ``num_new_tokens`` more tokens.

        Returns ``(host_block_id, device_block_id)`` copies, or None (nothing changed) when the
        device pool is short.
        """
        host = self._host_tables[request.request_id]
        if not self.allocate_slots(request, num_new_tokens):
            return None
        device = self._tables[request.request_id]
        copies = [(h, device[i].block_id) for i, h in enumerate(host)]
        self._free_host_blocks.extend(reversed(self._host_tables.pop(request.request_id)))
        return copies

    def free_host(self, request: Request) -> None:
        """Drop a swapped request's host blocks (it was aborted while swapped)."""
        self._free_host_blocks.extend(reversed(self._host_tables.pop(request.request_id, [])))

    def host_block_ids(self, request_id: str) -> list[int]:
        return list(self._host_tables.get(request_id, ()))

    def check_integrity(self) -> None:
        self.pool.check_integrity(self._tables.values())
        held = [b for table in self._host_tables.values() for b in table]
        assert len(held) == len(set(held)), "a host block is held twice"
        assert sorted(held + self._free_host_blocks) == list(range(self.num_host_blocks))
