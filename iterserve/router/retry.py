"""When the router tries a request again, and where.

An attempt fails *before the first byte* (nothing has reached the client yet, so another
replica can still answer) in one of four ways, its :data:`RetryReason`:

- ``connect``: refused, reset or closed before the response headers;
- ``timeout``: no response headers within the first-byte timeout;
- ``status_5xx``: the replica answered 5xx;
- ``status_429``: the replica is full (a healthy replica: not counted against it).

A failure after the first byte (a stream cut off) is never retried: the client has part of an
answer. :class:`RetryPolicy` decides; :class:`Attempts` is one request's record of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from iterserve.router.scoring import ReplicaState

RetryReason = Literal["connect", "timeout", "status_5xx", "status_429"]
RETRY_REASONS: tuple[RetryReason, ...] = get_args(RetryReason)


@dataclass(frozen=True)
class UpstreamAnswer:
    """A replica's whole answer (a 429 or 5xx), kept to pass it through when no retry does
    better. ``headers`` are the ones relayed to the client, as raw ASGI pairs."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class AttemptFailed(Exception):
    """An attempt that failed before any byte went to the client.

    Args:
        reason: how it failed (module docstring).
        answer: the replica's answer, when it gave one (429, 5xx).
    """

    def __init__(self, reason: RetryReason, answer: UpstreamAnswer | None = None) -> None:
        super().__init__(reason)
        self.reason: RetryReason = reason
        self.answer = answer


@dataclass(frozen=True)
class RetryPolicy:
    """Which failed attempts are tried again.

    Args:
        max_attempts: attempts per request, each on a replica not tried before.
        retry_on: the failure reasons worth another replica.
    """

    max_attempts: int = 2
    retry_on: frozenset[RetryReason] = frozenset(RETRY_REASONS)

    def should_retry(self, failure: AttemptFailed, num_attempts: int, client_gone: bool) -> bool:
        """Whether a request whose ``num_attempts``-th attempt failed with ``failure`` gets
        another: not when its client has gone (or the router's shutdown ended it)."""
        return (
            not client_gone and failure.reason in self.retry_on and num_attempts < self.max_attempts
        )

    @staticmethod
    def counts_against_replica(failure: AttemptFailed) -> bool:
        """Whether ``failure`` counts toward the replica's ejection (a full replica's 429
        does not: it answers, it is only busy)."""
        return failure.reason != "status_429"


@dataclass
class Attempts:
    """One request's attempts: the replicas tried (excluded from later picks, in order), the
    last failure, and the last answer a replica gave (a 429 or 5xx, passed through when the
    retry fails without one)."""

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    tried: list[str] = field(default_factory=list)
    last: AttemptFailed | None = None
    answer: UpstreamAnswer | None = None

    def may_start(self, client_gone: bool = False) -> bool:
        """Whether another attempt may start: the first always; another after a failure the
        policy retries."""
        if not self.tried:
            return True
        last = self.last
        return last is not None and self.policy.should_retry(last, len(self.tried), client_gone)

    def candidates(self, replicas: list[ReplicaState]) -> list[ReplicaState]:
        """``replicas`` less the ones tried."""
        return [r for r in replicas if r.name not in self.tried]

    def started(self, name: str) -> None:
        self.tried.append(name)

    def failed(self, failure: AttemptFailed) -> None:
        self.last = failure
        self.answer = failure.answer or self.answer
