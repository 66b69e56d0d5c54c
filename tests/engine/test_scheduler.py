"""Scheduler and LLMEngine with a fake runner: exact batches, admission, preemption, aborts."""

from __future__ import annotations

import pytest
from engine_fakes import EOS, VOCAB_SIZE, FakeRunner, Harness, completion, expected_output, prompt

from iterserve.config import ConfigError
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.request import RequestStatus

# ----------------------------------------------------------------- token budget


def test_budget_goes_to_decodes_first_then_prefill_chunks() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add("a", prompt(3))
    h.add("b", prompt(3))
    h.add("c", prompt(12))
    assert h.step() == [("a", 0, 3, True), ("b", 0, 3, True), ("c", 0, 2, False)]
    assert h.step() == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 2, 6, False)]
    assert h.step() == [("a", 4, 1, True), ("b", 4, 1, True), ("c", 8, 4, True)]
    assert h.step() == [("a", 5, 1, True), ("b", 5, 1, True), ("c", 12, 1, True)]
    out = h.run()
    assert completion(out["c"]) == (expected_output("c", 12, 4), "length")
    assert completion(out["a"]) == (expected_output("a", 3, 4), "length")


def test_prefill_chunks_are_capped_by_the_threshold_and_the_budget() -> None:
    h = Harness(max_num_batched_tokens=16, long_prefill_token_threshold=5)
    h.add("a", prompt(12))
    h.add("b", prompt(12))
    h.add("c", prompt(3))
    h.add("d", prompt(7))
    assert h.step() == [
        ("a", 0, 5, False),
        ("b", 0, 5, False),
        ("c", 0, 3, True),
        ("d", 0, 3, False),
    ]
    # c decodes first; then prefills in admission order, d gets what is left (4 of 5).
    assert h.step() == [
        ("c", 3, 1, True),
        ("a", 5, 5, False),
        ("b", 5, 5, False),
        ("d", 3, 4, True),
    ]
    assert h.step() == [
        ("c", 4, 1, True),
        ("d", 7, 1, True),
        ("a", 10, 2, True),
        ("b", 10, 2, True),
    ]
    assert h.last_output().num_scheduled_tokens == 6
    h.run()


def test_budget_stops_admission_when_spent() -> None:
    h = Harness(max_num_batched_tokens=4)
    h.add("a", prompt(4))
    h.add("b", prompt(2))
    assert h.step() == [("a", 0, 4, True)]
    assert h.status("b") == RequestStatus.WAITING
    assert h.step() == [("a", 4, 1, True), ("b", 0, 2, True)]


def test_max_num_seqs_limits_admission() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=16)
    h.add("a", prompt(2), max_tokens=2)
    h.add("b", prompt(2), max_tokens=2)
    h.add("c", prompt(2), max_tokens=2)
    assert h.step() == [("a", 0, 2, True), ("b", 0, 2, True)]
    assert len(h.engine.scheduler.running) == 2
    assert h.status("c") == RequestStatus.WAITING
    # a and b finish in this step; c was not admitted because they were still running.
    assert h.step() == [("a", 2, 1, True), ("b", 2, 1, True)]
    assert set(h.finished) == {"a", "b"}
    assert h.step() == [("c", 0, 2, True)]
    out = h.run()
    for request_id in "abc":
        assert completion(out[request_id]) == (expected_output(request_id, 2, 2), "length")


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget() -> None:
    h = Harness(enable_chunked_prefill=False, max_model_len=16, max_num_batched_tokens=16)
    h.add("a", prompt(10))
    h.add("b", prompt(8))
    h.add("c", prompt(2))  # behind b: first come, first served
    assert h.step() == [("a", 0, 10, True)]
    assert h.status("b") == RequestStatus.WAITING
    assert h.status("c") == RequestStatus.WAITING
    assert h.step() == [("a", 10, 1, True), ("b", 0, 8, True), ("c", 0, 2, True)]
    h.run()


def test_with_chunked_prefill_the_same_prompt_is_split() -> None:
    h = Harness(enable_chunked_prefill=True, max_model_len=16, max_num_batched_tokens=16)
    h.add("a", prompt(10))
    h.add("b", prompt(8))
    assert h.step() == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert h.step() == [("a", 10, 1, True), ("b", 6, 2, True)]


# ----------------------------------------------------------------- blocks


def test_finished_request_frees_blocks_and_next_step_admits_into_them() -> None:
    h = Harness(num_kv_blocks=3, max_model_len=16)
    h.add("a", prompt(8), max_tokens=1)
    h.add("b", prompt(8, first=20), max_tokens=1)
    assert h.step() == [("a", 0, 8, True)]  # b needs 2 blocks, 1 is free
    # a finished in that step and gave its blocks back (tail first) at once.
    assert completion(h.finished["a"]) == (expected_output("a", 8, 1), "length")
    assert h.kv_free == 3
    assert h.engine.scheduler.kv.pool.free_block_ids() == [2, 1, 0]
    assert h.status("b") == RequestStatus.WAITING
    assert h.step() == [("b", 0, 8, True)]
    assert completion(h.finished["b"]) == (expected_output("b", 8, 1), "length")
    assert h.kv_free == 3


def test_eos_stops_a_request_and_frees_its_blocks() -> None:
    h = Harness(FakeRunner(eos_at={"a": 5}))
    h.add("a", prompt(3), max_tokens=10)
    h.add("b", prompt(3), max_tokens=3)
    out = h.run()
    assert completion(out["a"]) == ([*expected_output("a", 3, 2), EOS], "stop")
    assert completion(out["b"]) == (expected_output("b", 3, 3), "length")
    assert h.kv_free == 64


def test_preemption_recomputes_the_newest_request_without_duplicating_output() -> None:
    # 4 blocks of 2 slots; each request needs up to 4 blocks (3 prompt + 5 outputs in the KV).
    h = Harness(num_kv_blocks=4, block_size=2, max_model_len=16)
    h.add("a", prompt(3), max_tokens=6)
    h.add("b", prompt(3, first=20), max_tokens=6)
    assert h.step() == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert (h.block_ids("a"), h.block_ids("b")) == ([0, 1], [2, 3])
    assert h.step() == [("a", 3, 1, True), ("b", 3, 1, True)]
    # a's 5th token needs a 3rd block: b (admitted last) is preempted and a takes b's tail.
    assert h.step() == [("a", 4, 1, True)]
    assert h.last_output().preempted_request_ids == ["b"]
    assert h.status("b") == RequestStatus.PREEMPTED
    assert h.block_ids("a") == [0, 1, 3]
    assert h.block_ids("b") == []
    b = h.engine.scheduler.requests["b"]
    assert (b.num_computed_tokens, b.output_token_ids) == (0, expected_output("b", 3, 2))
    assert h.engine.scheduler.num_preemptions == 1
    # b needs 3 blocks for its 5 tokens; 1 is free: it waits while a grows into the last one.
    assert h.step() == [("a", 5, 1, True)]
    assert h.step() == [("a", 6, 1, True)]
    assert h.block_ids("a") == [0, 1, 3, 2]
    assert h.step() == [("a", 7, 1, True)]
    assert completion(h.finished["a"]) == (expected_output("a", 3, 6), "length")
    # b recomputes prompt and output (5 tokens) in one chunk and samples its 3rd token.
    assert h.step() == [("b", 0, 5, True)]
    assert b.num_preemptions == 1
    out = h.run()
    assert completion(out["b"]) == (expected_output("b", 3, 6), "length")

    unpreempted = Harness(num_kv_blocks=64, block_size=2, max_model_len=16)
    unpreempted.add("a", prompt(3), max_tokens=6)
    unpreempted.add("b", prompt(3, first=20), max_tokens=6)
    reference = unpreempted.run()
    assert unpreempted.engine.scheduler.num_preemptions == 0
    for request_id in "ab":
        assert completion(out[request_id]) == completion(reference[request_id])
    # Every position of b was sampled exactly once, preemption included.
    sampled = [
        s.seq_len for o in h.runner.outputs for s in o.scheduled if s.request_id == "b" and s.sample
    ]
    assert sampled == [3, 4, 5, 6, 7, 8]


def test_preemption_of_a_prefill_in_progress() -> None:
    h = Harness(num_kv_blocks=4, block_size=2, max_model_len=16, max_num_batched_tokens=4)
    h.add("a", prompt(3), max_tokens=6)
    h.add("b", prompt(6, first=20), max_tokens=2)
    assert h.step() == [("a", 0, 3, True), ("b", 0, 1, False)]
    assert h.step() == [("a", 3, 1, True), ("b", 1, 3, False)]
    assert (h.block_ids("a"), h.block_ids("b")) == ([0, 1], [2, 3])
    assert h.step() == [("a", 4, 1, True)]  # b preempted halfway through its prompt
    assert h.last_output().preempted_request_ids == ["b"]
    out = h.run()
    assert completion(out["a"]) == (expected_output("a", 3, 6), "length")
    assert completion(out["b"]) == (expected_output("b", 6, 2), "length")
    assert h.kv_free == 4


def test_request_alone_that_outgrows_the_pool_finishes_with_length() -> None:
    h = Harness(num_kv_blocks=2, block_size=2, max_model_len=16)
    h.add("a", prompt(3), max_tokens=5)
    assert h.step() == [("a", 0, 3, True)]
    assert h.step() == [("a", 3, 1, True)]
    assert h.step() == []  # position 4 needs a 3rd block that does not exist
    assert completion(h.finished["a"]) == (expected_output("a", 3, 2), "length")
    assert not h.engine.has_unfinished_requests()
    assert h.kv_free == 2


# ----------------------------------------------------------------- aborts


# b's state after n steps: waiting, admitted (chunked), preempted by a at step 5, readmitted
# for a 3-token chunk into the 2 blocks its preemption freed at step 6.
B_STATUS_AFTER_STEP = [RequestStatus.WAITING] + [RequestStatus.RUNNING] * 4
B_STATUS_AFTER_STEP += [RequestStatus.PREEMPTED] + [RequestStatus.RUNNING] * 2


@pytest.mark.parametrize(("abort_step", "status_before"), list(enumerate(B_STATUS_AFTER_STEP)))
def test_abort_at_any_step_frees_every_block(abort_step: int, status_before: RequestStatus) -> None:
    h = Harness(num_kv_blocks=6, block_size=2, max_model_len=16, max_num_batched_tokens=4)
    h.add("a", prompt(3), max_tokens=6)
    h.add("b", prompt(5, first=20), max_tokens=4)
    h.add("c", prompt(2, first=9), max_tokens=3)
    for _ in range(abort_step):
        h.step()
    assert h.status("b") == status_before
    free_before = h.kv_free
    num_blocks_b = len(h.block_ids("b"))
    out = h.abort("b")
    assert completion(out)[1] == "abort"
    assert h.block_ids("b") == []
    assert h.kv_free == free_before + num_blocks_b
    assert "b" not in h.engine.scheduler.requests
    assert h.engine.abort_request("b") == []  # already gone: ignored
    h.run()
    assert completion(h.finished["a"]) == (expected_output("a", 3, 6), "length")
    assert completion(h.finished["c"]) == (expected_output("c", 2, 3), "length")
    assert h.kv_free == 6


def test_abort_reports_finished_id_to_the_runner_once() -> None:
    h = Harness()
    h.add("a", prompt(3), max_tokens=4)
    h.add("b", prompt(3), max_tokens=4)
    h.step()
    h.abort("a")
    h.step()
    assert h.last_output().finished_request_ids == ["a"]
    h.step()
    assert h.last_output().finished_request_ids == []


def test_abort_everything_frees_the_pool() -> None:
    h = Harness(num_kv_blocks=8, block_size=2)
    for i in range(4):
        h.add(f"r{i}", prompt(5, first=i), max_tokens=8)
    h.step()
    h.step()
    outs = h.engine.abort_request([f"r{i}" for i in range(4)])
    assert [o.request_id for o in outs] == ["r0", "r1", "r2", "r3"]
    assert all(completion(o)[1] == "abort" for o in outs)
    h.engine.scheduler.check_integrity()
    assert h.kv_free == 8
    assert not h.engine.has_unfinished_requests()


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("prompt_token_ids", "max_tokens", "param", "message"),
    [
        ([], 4, "prompt", "the prompt is empty"),
        (prompt(10), 7, "max_tokens", "maximum context length is 16 tokens"),
        (prompt(16), 1, "prompt", "maximum context length is 16 tokens"),
        ([3, VOCAB_SIZE, 4], 2, "prompt", r"integers in \[0, 32\), got \[32\]"),
        ([3, -1], 2, "prompt", r"got \[-1\]"),
        (prompt(13), 2, "prompt", "needs 4 KV blocks but the whole pool has 3 blocks"),
    ],
)
def test_add_request_rejects_what_can_never_be_served(
    prompt_token_ids: list[int], max_tokens: int, param: str, message: str
) -> None:
    h = Harness(num_kv_blocks=3, block_size=4, max_model_len=16)
    h.add("ok", prompt(5), max_tokens=3)
    h.step()
    with pytest.raises(InvalidRequestError, match=message) as info:
        h.add("bad", prompt_token_ids, max_tokens=max_tokens)
    assert info.value.param == param
    assert "bad" not in h.engine.scheduler.requests
    out = h.run()
    assert set(out) == {"ok"}
    assert completion(out["ok"]) == (expected_output("ok", 5, 3), "length")


def test_prompt_filling_the_whole_pool_is_accepted() -> None:
    h = Harness(num_kv_blocks=3, block_size=4, max_model_len=16)
    h.add("full", prompt(12), max_tokens=2)
    out = h.run()
    # Its first output token fits; the second needs a 4th block.
    assert completion(out["full"]) == (expected_output("full", 12, 1), "length")


def test_duplicate_request_id_is_rejected() -> None:
    h = Harness()
    h.add("a", prompt(3))
    with pytest.raises(ValueError, match="already in use"):
        h.add("a", prompt(3))
    h.run()


# ----------------------------------------------------------------- runner contract


def test_every_finished_request_id_reaches_the_runner() -> None:
    """SchedulerOutput.finished_request_ids tells the runner to drop per-request state.

    "a" outgrows the pool alone: it is finished inside schedule(), whose batch is then empty,
    so the engine skips the runner for that iteration. Its id must still reach the runner
    with the next batch it does run.
    """
    h = Harness(num_kv_blocks=2, block_size=2, max_model_len=16)
    h.add("a", prompt(3), max_tokens=5)
    h.step()
    h.step()
    assert h.step() == []  # "a" finished for lack of blocks; no forward ran
    assert completion(h.finished["a"]) == (expected_output("a", 3, 2), "length")
    h.add("b", prompt(2), max_tokens=2)
    h.run()
    reported = [rid for out in h.runner.outputs for rid in out.finished_request_ids]
    assert reported == ["a"]


def test_aborted_ids_reach_the_runner_after_an_empty_iteration() -> None:
    h = Harness()
    h.add("a", prompt(3), max_tokens=4)
    h.step()
    h.abort("a")
    assert h.step() == []  # nothing left to compute, but the runner hears of the abort
    assert h.last_output().finished_request_ids == ["a"]
    h.add("b", prompt(3), max_tokens=1)
    assert h.step() == [("b", 0, 3, True)]
    assert h.last_output().finished_request_ids == []


def test_without_chunked_prefill_the_threshold_is_refused() -> None:
    """Chunked prefill off means a prompt is prefilled whole: a threshold would split it."""
    with pytest.raises(ConfigError, match="needs chunked prefill"):
        Harness(
            enable_chunked_prefill=False,
            long_prefill_token_threshold=4,
            max_model_len=16,
            max_num_batched_tokens=16,
        )
