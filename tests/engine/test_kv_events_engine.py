"""KV-cache events from the block pool and the KV-cache manager (exact events per step), and
the engine loop publishing one batch per iteration that changed the prefix cache."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine_fakes import Harness, prompt

from iterserve.engine.engine_core import EngineCore
from iterserve.engine.kv_cache_manager import KVCacheManager
from iterserve.engine.messages import (
    AddRequest,
    EngineCommand,
    EngineMessage,
    Shutdown,
    StepResult,
)
from iterserve.engine.request import Request
from iterserve.engine.sampling_params import SamplingParams
from iterserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    prompt_block_hashes,
)

BS = 4


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=8), arrival_time=0.0)


def compute(kv: KVCacheManager, request: Request, num_new_tokens: int) -> list[KVCacheEvent]:
    """One step's worth for ``request`` (as the scheduler does it); the events it caused."""
    assert kv.allocate_slots(request, num_new_tokens)
    request.num_computed_tokens += num_new_tokens
    kv.cache_full_blocks(request)
    kv.check_integrity()
    return kv.pool.take_events()


def stored(tokens: Sequence[int], first: int, last: int) -> BlockStored:
    """BlockStored of blocks ``first..last`` (inclusive) of the chain over ``tokens``."""
    hashes = prompt_block_hashes(tokens, BS)
    return BlockStored(
        block_hashes=tuple(hashes[first : last + 1]),
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tuple(tokens[first * BS : (last + 1) * BS]),
        block_size=BS,
    )


def test_nothing_is_recorded_until_enabled() -> None:
    kv = KVCacheManager(8, BS)
    assert compute(kv, make_request("a", list(range(9))), 9) == []
    assert kv.pool.kv_events is None


def test_full_blocks_are_stored_once_each_with_their_parent_and_tokens() -> None:
    kv = KVCacheManager(16, BS)
    kv.pool.enable_kv_events()
    tokens = list(range(100, 111))  # 11 tokens: 2 full blocks and 3 tokens
    a = make_request("a", tokens)
    assert compute(kv, a, 3) == []  # chunked prefill: no block full yet
    assert compute(kv, a, 8) == [stored(tokens, 0, 1)]  # both full blocks in one event
    a.append_output_token(7)  # token 11 fills block 2
    assert compute(kv, a, 1) == [stored([*tokens, 7], 2, 2)]
    a.append_output_token(8)  # token 12 starts block 3: nothing new is full
    assert compute(kv, a, 1) == []

    # A prompt sharing the first block: a hit (no event), then its own second block.
    other = [*tokens[:4], 1, 2, 3, 4, 5]
    b = make_request("b", other)
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 1
    assert kv.allocate_slots(b, len(other) - BS, hits)
    b.num_computed_tokens = len(other)
    kv.cache_full_blocks(b)
    assert kv.pool.take_events() == [stored(other, 1, 1)]
    assert kv.pool.take_events() == []  # taken


def test_a_prefix_another_block_already_holds_is_not_stored_again() -> None:
    """Two requests computing the same first block at once: the first writer caches it; the
    second's copy stays private (no event), and its next block is a run of its own whose
    parent is the shared hash."""
    kv = KVCacheManager(16, BS)
    kv.pool.enable_kv_events()
    a_tokens = list(range(8))
    d_tokens = [*range(4), 50, 51, 52, 53]
    a, d = make_request("a", a_tokens), make_request("d", d_tokens)
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(d, 8)
    a.num_computed_tokens = d.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.cache_full_blocks(d)
    assert kv.pool.take_events() == [stored(a_tokens, 0, 1), stored(d_tokens, 1, 1)]


def test_eviction_is_block_removed_in_eviction_order_and_reset_clears_all() -> None:
    kv = KVCacheManager(4, BS)
    kv.pool.enable_kv_events()
    tokens = list(range(12))
    a = make_request("a", tokens)
    assert compute(kv, a, 12) == [stored(tokens, 0, 2)]
    kv.free(a)  # blocks stay cached (freed tail first: block 2 is evicted first)
    assert kv.pool.take_events() == []
    b = make_request("b", list(range(200, 212)))  # no hit; needs 3 blocks of 4
    hashes = prompt_block_hashes(tokens, BS)
    events = compute(kv, b, 12)
    # The free queue: [the never-used block, a's block 2, 1, 0]: one allocation evicts two.
    assert events[0] == BlockRemoved((hashes[2], hashes[1]))
    assert events[1:] == [stored(b.all_token_ids, 0, 2)]
    kv.pool.reset_prefix_cache()
    assert kv.pool.take_events() == [AllBlocksCleared()]


class RecordingPublisher:
    """Stands in for KVEventPublisher: the batches the engine loop published."""

    def __init__(self) -> None:
        self.batches: list[list[KVCacheEvent]] = []
        self.num_dropped_batches = 3  # as if 3 had been dropped before

    def publish(self, events: Sequence[KVCacheEvent]) -> bool:
        self.batches.append(list(events))
        return True


def test_the_engine_loop_publishes_one_batch_per_iteration_that_changed_the_cache() -> None:
    h = Harness(enable_prefix_caching=True, max_num_batched_tokens=8, max_num_seqs=4)
    publisher = RecordingPublisher()
    tokens = prompt(12)
    pending: deque[EngineCommand] = deque(
        [AddRequest("a", tokens, SamplingParams(max_tokens=2, ignore_eos=True), 1, 0.0)]
    )

    def recv(block: bool) -> EngineCommand | None:
        if pending:
            return pending.popleft()
        return Shutdown() if block else None

    sent: list[EngineMessage] = []
    EngineCore(h.engine, sent.append, kv_publisher=publisher).run(recv)  # type: ignore[arg-type]
    # 12 prompt tokens in chunks of 8 then 4: blocks 0-1, then block 2; decode fills none.
    assert publisher.batches == [
        [stored(tokens, 0, 1)],
        [stored(tokens, 2, 2)],
    ]
    # Every step's result carries the publisher's drop count (the server's metric).
    results = [m for m in sent if isinstance(m, StepResult)]
    assert results and all(m.num_kv_events_dropped == 3 for m in results)
