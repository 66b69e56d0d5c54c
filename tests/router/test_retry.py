"""The retry policy alone: which failed attempts are tried again, on which replicas, and
what a request gets when none answered."""

from __future__ import annotations

import pytest

from iterserve.router.proxy import answer_after
from iterserve.router.retry import (
    RETRY_REASONS,
    AttemptFailed,
    Attempts,
    RetryPolicy,
    UpstreamAnswer,
)
from iterserve.router.scoring import ReplicaState

FULL = UpstreamAnswer(429, [(b"retry-after", b"7")], b"{}")
BROKEN = UpstreamAnswer(503, [], b"down")


@pytest.mark.parametrize("reason", RETRY_REASONS)
def test_every_failure_before_the_first_byte_is_retried_once(reason: str) -> None:
    policy = RetryPolicy()
    failure = AttemptFailed(reason)
    assert policy.should_retry(failure, num_attempts=1, client_gone=False)
    assert not policy.should_retry(failure, num_attempts=2, client_gone=False)
    assert not policy.should_retry(failure, num_attempts=1, client_gone=True)


def test_only_the_listed_reasons_are_retried() -> None:
    policy = RetryPolicy(max_attempts=3, retry_on=frozenset({"connect"}))
    assert policy.should_retry(AttemptFailed("connect"), 2, client_gone=False)
    assert not policy.should_retry(AttemptFailed("connect"), 3, client_gone=False)
    assert not policy.should_retry(AttemptFailed("timeout"), 1, client_gone=False)


def test_a_full_replica_is_not_counted_against_its_health() -> None:
    assert not RetryPolicy.counts_against_replica(AttemptFailed("status_429", FULL))
    for reason in ("connect", "timeout", "status_5xx"):
        assert RetryPolicy.counts_against_replica(AttemptFailed(reason))


def test_attempts_exclude_the_replicas_tried() -> None:
    replicas = [ReplicaState("a"), ReplicaState("b"), ReplicaState("c")]
    attempts = Attempts(RetryPolicy(max_attempts=3))
    assert attempts.may_start()
    assert attempts.candidates(replicas) == replicas
    attempts.started("b")
    assert not attempts.may_start()  # started, not failed: no second attempt
    attempts.failed(AttemptFailed("connect"))
    assert attempts.may_start()
    assert [r.name for r in attempts.candidates(replicas)] == ["a", "c"]
    assert not attempts.may_start(client_gone=True)
    attempts.started("a")
    attempts.failed(AttemptFailed("timeout"))
    assert [r.name for r in attempts.candidates(replicas)] == ["c"]
    attempts.started("c")
    attempts.failed(AttemptFailed("connect"))
    assert not attempts.may_start()
    assert attempts.tried == ["b", "a", "c"]


def test_the_last_answer_a_replica_gave_is_kept_through_later_failures() -> None:
    attempts = Attempts()
    attempts.started("a")
    attempts.failed(AttemptFailed("status_429", FULL))
    attempts.started("b")
    attempts.failed(AttemptFailed("connect"))  # no answer: the 429 stays
    assert attempts.answer is FULL
    assert attempts.last is not None and attempts.last.reason == "connect"
    assert answer_after(attempts) is FULL
    attempts.failed(AttemptFailed("status_5xx", BROKEN))
    assert answer_after(attempts) is BROKEN


def test_without_any_answer_a_502_or_a_503_to_retry_later() -> None:
    error = answer_after(Attempts())  # no replica was ready
    assert not isinstance(error, UpstreamAnswer)
    assert (error.status, error.type, error.headers) == (
        503,
        "service_unavailable_error",
        {"retry-after": "1"},
    )
    attempts = Attempts()
    attempts.started("a")
    attempts.failed(AttemptFailed("timeout"))
    error = answer_after(attempts)
    assert not isinstance(error, UpstreamAnswer)
    assert (error.status, error.type, error.message) == (
        502,
        "bad_gateway",
        "the replicas failed (timeout)",
    )
    assert error.headers == {"retry-after": "1"}
