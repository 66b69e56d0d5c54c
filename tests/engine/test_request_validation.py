"""Request-level validation that needs no model: seeds, stop ids, id collisions."""

from __future__ import annotations

import pytest
from engine_fakes import Harness

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**63])
def test_seeds_outside_signed_64_bits_are_rejected(seed: int) -> None:
    with pytest.raises(InvalidRequestError, match="seed") as e:
        SamplingParams(seed=seed)
    assert e.value.param == "seed"


def test_seed_leaves_room_for_every_completion() -> None:
    SamplingParams(seed=2**63 - 2, n=2)
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**63 - 1, n=2)


@pytest.mark.parametrize("repetition_penalty", [0.0, 1e-40, 0.009, 10.5])
def test_repetition_penalty_range(repetition_penalty: float) -> None:
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=repetition_penalty)


def test_stop_token_ids_outside_the_vocab_are_rejected() -> None:
    h = Harness()
    vocab = h.engine.vocab_size
    with pytest.raises(InvalidRequestError, match="stop_token_ids") as e:
        h.engine.add_request("a", [5, 6], SamplingParams(stop_token_ids=[vocab], min_tokens=1))
    assert e.value.param == "stop_token_ids"
    assert not h.engine.has_unfinished_requests()


def test_colliding_completion_ids_queue_nothing() -> None:
    h = Harness()
    h.engine.add_request("a#1", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        h.engine.add_request("a", [5, 6, 7], SamplingParams(n=2, max_tokens=2))
    assert set(h.engine.scheduler.requests) == {"a#1"}
    h.engine.abort_request("a#1")
    h.engine.scheduler.check_integrity()
    assert not h.engine.has_unfinished_requests()


def test_error_for_a_huge_stop_list_is_short() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=["x"] * 50_000)
    assert e.value.param == "stop" and len(str(e.value)) < 400
