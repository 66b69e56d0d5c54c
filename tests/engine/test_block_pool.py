"""BlockPool: exact block ids, free-queue order, prefix-cache LRU eviction and ref counts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from iterserve.engine.block_pool import BlockPool, KVBlock, hash_block_tokens


def ids(blocks: Sequence[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def chain_hashes(token_blocks: Sequence[Sequence[int]]) -> list[bytes]:
    """Chain hashes of consecutive full blocks, as the KV cache manager computes them."""
    out: list[bytes] = []
    for tokens in token_blocks:
        out.append(hash_block_tokens(out[-1] if out else None, tokens))
    return out


H0, H1, H2, H3 = chain_hashes([[1, 2], [3, 4], [5, 6], [7, 8]])


def test_new_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(6)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(5 / 6)
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0]


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [2]
    pool.check_integrity([a])


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)


def test_freed_blocks_go_to_tail_in_the_order_given() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0 1 2
    b = pool.allocate(2)  # 3 4
    pool.check_integrity([a, b])
    # A request's table is freed last-first.
    pool.free(reversed(a))
    assert pool.free_block_ids() == [5, 2, 1, 0]
    pool.check_integrity([b])
    pool.free(reversed(b))
    assert pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    pool.check_integrity([])
    # Allocation reuses the queue head first.
    assert ids(pool.allocate(3)) == [5, 2, 1]
    assert pool.free_block_ids() == [0, 4, 3]


def test_cached_blocks_count_as_free_and_as_cached() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)  # 0 1 2
    pool.cache_block(a[0], H0)
    pool.cache_block(a[1], H1)
    assert pool.num_cached_blocks == 0  # still owned
    assert pool.get_cached_block(H0) is a[0]
    pool.check_integrity([a])
    pool.free(reversed(a))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.num_free_blocks == 4
    assert pool.num_cached_blocks == 2
    assert pool.usage == 0.0
    pool.check_integrity([])


def test_eviction_takes_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0 1
    b = pool.allocate(2)  # 2 3
    for block, h in zip(a + b, [H0, H1, H2, H3], strict=True):
        pool.cache_block(block, h)
    pool.free(reversed(b))  # queue: 3 2
    pool.free(reversed(a))  # queue: 3 2 1 0
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.num_cached_blocks == 4

    first = pool.allocate(1)
    assert ids(first) == [3]
    assert first[0].block_hash is None
    assert pool.get_cached_block(H3) is None
    assert pool.num_cached_blocks == 3
    pool.check_integrity([first])

    second = pool.allocate(2)
    assert ids(second) == [2, 1]
    assert pool.get_cached_block(H2) is None
    assert pool.get_cached_block(H1) is None
    assert pool.get_cached_block(H0) is pool.blocks[0]
    assert pool.num_cached_blocks == 1
    assert pool.num_free_blocks == 1
    pool.check_integrity([first, second])


def test_touch_of_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0 1
    pool.cache_block(a[0], H0)
    pool.free(reversed(a))  # queue: 2 3 1 0
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.num_cached_blocks == 1

    hit = pool.get_cached_block(H0)
    assert hit is pool.blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3
    assert pool.num_cached_blocks == 0
    assert hit.block_hash == H0  # still registered: others may hit it too
    pool.check_integrity([[hit]])

    # Allocating every free block never evicts the touched one.
    rest = pool.allocate(3)
    assert ids(rest) == [2, 3, 1]
    assert pool.get_cached_block(H0) is hit
    pool.check_integrity([[hit], rest])


def test_shared_block_ref_counts() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)  # 0 1
    pool.cache_block(a[0], H0)
    hit = pool.get_cached_block(H0)
    assert hit is not None
    pool.touch([hit])  # owned: only the ref count grows
    assert hit.ref_cnt == 2
    assert pool.free_block_ids() == [2]
    table_b = [hit, *pool.allocate(1)]  # 0 2
    assert ids(table_b) == [0, 2]
    pool.check_integrity([a, table_b])

    pool.free(reversed(a))  # block 0 still owned by b
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [1]
    assert pool.num_cached_blocks == 0
    pool.check_integrity([table_b])

    pool.free(reversed(table_b))
    assert pool.free_block_ids() == [1, 2, 0]
    assert pool.num_cached_blocks == 1
    pool.check_integrity([])


def test_cache_block_first_writer_wins() -> None:
    pool = BlockPool(3)
    a = pool.allocate(1)  # 0
    b = pool.allocate(1)  # 1
    pool.cache_block(a[0], H0)
    pool.cache_block(b[0], H0)  # same prefix computed twice: b's copy stays private
    assert pool.get_cached_block(H0) is a[0]
    assert b[0].block_hash is None
    # A block keeps its first hash.
    pool.cache_block(a[0], H1)
    assert a[0].block_hash == H0
    assert pool.get_cached_block(H1) is None
    pool.check_integrity([a, b])
    pool.free(b)
    pool.free(a)
    assert pool.num_cached_blocks == 1
    pool.check_integrity([])


def test_cache_block_is_a_no_op_without_caching() -> None:
    pool = BlockPool(2, enable_caching=False)
    a = pool.allocate(1)
    pool.cache_block(a[0], H0)
    assert a[0].block_hash is None
    assert pool.get_cached_block(H0) is None
    pool.free(a)
    assert pool.num_cached_blocks == 0
    pool.check_integrity([])


def test_reset_prefix_cache_forgets_hashes_in_place() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache_block(a[0], H0)
    pool.cache_block(a[1], H1)
    pool.free(reversed(a))  # queue: 2 1 0
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(H0) is None
    assert pool.free_block_ids() == [2, 1, 0]
    pool.check_integrity([])


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free(a)


def test_check_integrity_catches_corrupted_ref_count() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.check_integrity([a])
    a[1].ref_cnt = 2
    with pytest.raises(AssertionError, match="block 1: ref_cnt 2 != 1 owners"):
        pool.check_integrity([a])


def test_check_integrity_catches_a_missing_owner() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="block 0: ref_cnt 1 != 0 owners"):
        pool.check_integrity([])


def test_chain_hash_depends_on_the_whole_prefix() -> None:
    assert hash_block_tokens(None, [3, 4]) != H1  # same tokens, different parent
    assert hash_block_tokens(H0, [3, 4]) == H1
    assert len(H0) == 16
