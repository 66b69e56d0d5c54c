"""KVCacheManager: exact block tables, prefix-cache hits, the watermark and freeing."""

from __future__ import annotations

from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.request import Request
from iterserve.engine.sampling_params import SamplingParams

BS = 4  # block_size of every manager here


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=8), arrival_time=0.0)


def compute(kv: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """What the scheduler does around one forward: reserve slots, advance, cache full blocks."""
    assert kv.allocate_slots(request, num_new_tokens)
    request.num_computed_tokens += num_new_tokens
    kv.cache_full_blocks(request)
    kv.check_integrity()


def admit_with_hits(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit ``request`` reusing its cached prefix and compute the rest; returns the hit ids."""
    hits = kv.get_computed_blocks(request)
    num_computed = len(hits) * BS
    assert kv.allocate_slots(request, request.num_tokens - num_computed, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.check_integrity()
    return [b.block_id for b in hits]


def test_block_table_grows_across_chunks_and_decodes() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    req = make_request("a", list(range(10)))
    compute(kv, req, 3)  # tokens 0..2
    assert kv.block_ids("a") == [0]
    compute(kv, req, 4)  # tokens 3..6
    assert kv.block_ids("a") == [0, 1]
    compute(kv, req, 3)  # tokens 7..9
    assert kv.block_ids("a") == [0, 1, 2]
    req.append_output_token(50)  # token 10: fits in block 2
    compute(kv, req, 1)
    assert kv.block_ids("a") == [0, 1, 2]
    req.append_output_token(51)  # token 11: fills block 2
    compute(kv, req, 1)
    assert kv.block_ids("a") == [0, 1, 2]
    req.append_output_token(52)  # token 12: needs a new block
    compute(kv, req, 1)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7]


def test_interleaved_requests_get_interleaved_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", list(range(6)))
    b = make_request("b", list(range(100, 109)))
    compute(kv, a, 4)
    compute(kv, b, 8)
    compute(kv, a, 2)
    assert kv.block_ids("a") == [0, 3]
    assert kv.block_ids("b") == [1, 2]
    compute(kv, b, 1)
    assert kv.block_ids("b") == [1, 2, 4]
    assert kv.num_blocks_for(9) == 3


def test_free_returns_every_block_tail_first() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", list(range(6)))
    b = make_request("b", list(range(100, 109)))
    compute(kv, a, 6)  # 0 1
    compute(kv, b, 9)  # 2 3 4
    kv.free(b)
    assert kv.block_ids("b") == []
    assert kv.pool.free_block_ids() == [5, 6, 7, 4, 3, 2]
    kv.check_integrity()
    kv.free(a)
    assert kv.pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1, 0]
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity()
    kv.free(a)  # freeing an unknown request is a no-op
    kv.check_integrity()


def test_prefix_hit_stops_before_the_last_token() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # blocks 0 1 full and cached, 2 partial
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(a)

    exact = make_request("exact", list(range(8)))  # exactly 2 full blocks
    hits = kv.get_computed_blocks(exact)
    assert [h.block_id for h in hits] == [0]  # the last token must be computed

    longer = make_request("longer", [*range(8), 77])
    assert [h.block_id for h in kv.get_computed_blocks(longer)] == [0, 1]

    diverges = make_request("diverges", [0, 1, 2, 3, 4, 5, 6, 99, 8])
    assert [h.block_id for h in kv.get_computed_blocks(diverges)] == [0]

    other = make_request("other", [9, 9, 9, 9, 9])
    assert kv.get_computed_blocks(other) == []
    kv.check_integrity()  # looking up hits changes nothing


def test_only_computed_full_blocks_are_cached() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(12)))
    compute(kv, a, 7)  # block 0 full, block 1 has 3 of 4 tokens
    probe = make_request("probe", list(range(12)))
    assert [h.block_id for h in kv.get_computed_blocks(probe)] == [0]
    compute(kv, a, 1)  # block 1 full now
    assert [h.block_id for h in kv.get_computed_blocks(probe)] == [0, 1]


def test_hits_on_cached_free_blocks_leave_the_free_queue() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # 0 1 2
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert kv.pool.num_cached_blocks == 2

    b = make_request("b", [*range(8), 42, 43])
    assert admit_with_hits(kv, b) == [0, 1]
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 1
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2]
    assert kv.pool.num_cached_blocks == 0


def test_hits_on_blocks_of_a_running_request_are_shared() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # 0 1 2, a keeps running

    b = make_request("b", [*range(8), 42])
    assert admit_with_hits(kv, b) == [0, 1]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7]

    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2]
    kv.check_integrity()
    kv.free(b)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.pool.num_cached_blocks == 2
    kv.check_integrity()


def test_duplicate_prefix_computed_twice_keeps_the_first_copy() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(5)))
    b = make_request("b", list(range(5)))
    compute(kv, a, 5)  # 0 1
    compute(kv, b, 5)  # 2 3: block 2 holds the same prefix as block 0
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[2].block_hash is None
    probe = make_request("probe", list(range(6)))
    assert [h.block_id for h in kv.get_computed_blocks(probe)] == [0]


def test_watermark_refusal_changes_nothing() -> None:
    kv = KVCacheManager(10, BS, watermark=0.2)  # 2 blocks kept free at admission
    assert kv.num_watermark_blocks == 2
    a = make_request("a", list(range(24)))
    compute(kv, a, 24)  # 0..5, 4 free
    assert kv.pool.num_free_blocks == 4

    b = make_request("b", list(range(100, 112)))  # needs 3 blocks: 3 + 2 > 4
    free_before = kv.pool.free_block_ids()
    refs_before = [blk.ref_cnt for blk in kv.pool.blocks]
    assert not kv.allocate_slots(b, 12, use_watermark=True)
    assert kv.block_ids("b") == []
    assert kv.pool.free_block_ids() == free_before
    assert [blk.ref_cnt for blk in kv.pool.blocks] == refs_before
    kv.check_integrity()

    assert kv.allocate_slots(b, 8, use_watermark=True)  # 2 + 2 <= 4
    assert kv.block_ids("b") == [6, 7]
    # Without the watermark (a running request growing) the reserve may be used.
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 4)
    assert kv.block_ids("b") == [6, 7, 8]
    kv.check_integrity()


def test_unowned_hits_count_against_the_free_blocks() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # 0 1 2
    kv.free(a)  # 0 1 cached, all 4 free
    filler = make_request("filler", list(range(200, 204)))
    compute(kv, filler, 4)  # takes block 3
    assert kv.block_ids("filler") == [3]

    # 2 hits (both in the free queue) + 2 new blocks > 3 free: refused, nothing touched.
    b = make_request("b", [*range(8), 42, 43, 44, 45, 46])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    free_before = kv.pool.free_block_ids()
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.pool.free_block_ids() == free_before
    assert kv.pool.num_cached_blocks == 2
    assert kv.block_ids("b") == []
    kv.check_integrity()

    assert kv.allocate_slots(b, 4, hits)  # 2 hits + 1 new block = 3 free
    assert kv.block_ids("b") == [0, 1, 2]
    assert kv.pool.num_free_blocks == 0
    kv.check_integrity()


def test_allocation_evicts_the_tail_of_a_freed_prefix_first() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(13)))
    compute(kv, a, 13)  # 0 1 2 3, blocks 0 1 2 cached
    kv.free(a)  # queue: 3 2 1 0
    b = make_request("b", list(range(100, 106)))
    compute(kv, b, 6)  # evicts the tail of a's prefix first
    assert kv.block_ids("b") == [3, 2]
    probe = make_request("probe", list(range(13)))
    assert [h.block_id for h in kv.get_computed_blocks(probe)] == [0, 1]


def test_no_hits_without_caching() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == []
