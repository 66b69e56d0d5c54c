"""``batching="static"`` against ``batching="continuous"`` on the same workloads (fake runner).

Static batching admits a batch into an empty engine and admits nothing more until every
member has finished; admission into the batch may span several iterations while the token
budget is short and no member has produced a token yet.
"""

from __future__ import annotations

from typing import Any

import engine_fakes
import pytest
from engine_fakes import VOCAB_SIZE, expected_output

from iterserve.config import EngineConfig


class Harness(engine_fakes.Harness):
    """The shared harness in one batching mode; every request arrives at 0.0 (no aging).

    ``step_batch`` and ``run_batches`` record the rows and running count of every step.
    """

    def __init__(self, batching: str, **kwargs: Any) -> None:
        kwargs.setdefault("max_model_len", 32)
        super().__init__(batching=batching, clock=lambda: 0.0, max_steps=100, **kwargs)

    def numbered_prompt(self, request_id: str, n: int) -> list[int]:
        """``n`` tokens offset by the length of the request id."""
        return [2 + (i + len(request_id)) % (VOCAB_SIZE - 2) for i in range(n)]


def add_uneven_batch(h: Harness) -> None:
    h.add("a", 2, max_tokens=1)
    h.add("b", 2, max_tokens=4)
    h.add("c", 2, max_tokens=2)
    h.add("d", 2, max_tokens=2)


def check_outputs(h: Harness, specs: dict[str, tuple[int, int]]) -> None:
    assert set(h.finished) == set(specs)
    for request_id, (num_prompt, max_tokens) in specs.items():
        (c,) = h.finished[request_id].outputs
        assert (c.token_ids, c.finish_reason) == (
            expected_output(request_id, num_prompt, max_tokens),
            "length",
        )


UNEVEN = {"a": (2, 1), "b": (2, 4), "c": (2, 2), "d": (2, 2)}


def test_static_admits_the_next_batch_only_when_the_whole_batch_finished() -> None:
    h = Harness("static", max_num_seqs=2, max_num_batched_tokens=64)
    add_uneven_batch(h)
    assert h.run_batches() == [
        ([("a", 0, 2, True), ("b", 0, 2, True)], 1),  # a finishes at once
        ([("b", 2, 1, True)], 1),  # a's slot stays idle although c and d wait
        ([("b", 3, 1, True)], 1),
        ([("b", 4, 1, True)], 0),  # b finishes: the batch is done
        ([("c", 0, 2, True), ("d", 0, 2, True)], 2),
        ([("c", 2, 1, True), ("d", 2, 1, True)], 0),
    ]
    check_outputs(h, UNEVEN)


def test_continuous_admits_into_a_freed_slot_in_the_next_iteration() -> None:
    h = Harness("continuous", max_num_seqs=2, max_num_batched_tokens=64)
    add_uneven_batch(h)
    assert h.run_batches() == [
        ([("a", 0, 2, True), ("b", 0, 2, True)], 1),
        ([("b", 2, 1, True), ("c", 0, 2, True)], 2),  # c takes a's slot at once
        ([("b", 3, 1, True), ("c", 2, 1, True)], 1),
        ([("b", 4, 1, True), ("d", 0, 2, True)], 1),  # b finishes, d takes c's slot
        ([("d", 2, 1, True)], 0),
    ]
    check_outputs(h, UNEVEN)


PREFILLS = {"a": (6, 2), "b": (6, 2), "c": (6, 2)}


def test_static_admission_spans_iterations_until_a_member_has_a_token() -> None:
    h = Harness("static", max_num_seqs=3, max_num_batched_tokens=4)
    for request_id, (num_prompt, max_tokens) in PREFILLS.items():
        h.add(request_id, num_prompt, max_tokens)
    assert h.run_batches() == [
        ([("a", 0, 4, False)], 1),  # the budget admits only part of a's prompt
        ([("a", 4, 2, True), ("b", 0, 2, False)], 2),  # no token yet: b joins the batch
        ([("a", 6, 1, True), ("b", 2, 3, False)], 1),  # a has a token: c must wait
        ([("b", 5, 1, True)], 1),  # a's slot stays idle
        ([("b", 6, 1, True)], 0),
        ([("c", 0, 4, False)], 1),
        ([("c", 4, 2, True)], 1),
        ([("c", 6, 1, True)], 0),
    ]
    check_outputs(h, PREFILLS)


def test_continuous_keeps_admitting_whenever_budget_is_left() -> None:
    h = Harness("continuous", max_num_seqs=3, max_num_batched_tokens=4)
    for request_id, (num_prompt, max_tokens) in PREFILLS.items():
        h.add(request_id, num_prompt, max_tokens)
    assert h.run_batches() == [
        ([("a", 0, 4, False)], 1),
        ([("a", 4, 2, True), ("b", 0, 2, False)], 2),
        ([("a", 6, 1, True), ("b", 2, 3, False)], 1),
        ([("b", 5, 1, True), ("c", 0, 3, False)], 2),
        ([("b", 6, 1, True), ("c", 3, 3, True)], 1),
        ([("c", 6, 1, True)], 0),
    ]
    check_outputs(h, PREFILLS)


def test_static_slot_of_a_member_finished_during_prefill_stays_idle() -> None:
    """a produces its only token and finishes while b is still prefilling: the batch has
    produced a token, so c may not join it in a's slot; it waits until b finishes."""
    h = Harness("static", max_num_seqs=2, max_num_batched_tokens=4)
    h.add("a", 2, max_tokens=1)
    h.add("b", 5, max_tokens=1)
    h.add("c", 1, max_tokens=1)
    assert h.run_batches() == [
        ([("a", 0, 2, True), ("b", 0, 2, False)], 1),
        ([("b", 2, 3, True)], 0),
        ([("c", 0, 1, True)], 0),
    ]
    check_outputs(h, {"a": (2, 1), "b": (5, 1), "c": (1, 1)})


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_batches_follow_the_new_mode_after_a_live_change(batching: str) -> None:
    """The scheduler reads ``batching`` each iteration: a live change applies at once."""
    other = "continuous" if batching == "static" else "static"
    h = Harness(other, max_num_seqs=2, max_num_batched_tokens=64)
    add_uneven_batch(h)
    first, _ = h.step_batch()
    assert first == [("a", 0, 2, True), ("b", 0, 2, True)]
    config = EngineConfig.from_kwargs(
        batching=batching, max_num_seqs=2, max_num_batched_tokens=64, kv_watermark=0.0
    ).scheduler
    h.engine.update_scheduler_config(config)
    rows, running = h.step_batch()
    if batching == "static":
        assert (rows, running) == ([("b", 2, 1, True)], 1)
    else:
        assert (rows, running) == ([("b", 2, 1, True), ("c", 0, 2, True)], 2)
    h.run_batches()
    check_outputs(h, UNEVEN)
