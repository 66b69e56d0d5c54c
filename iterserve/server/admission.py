"""Admission control: a bounded queue, per-tier queue-wait limits, and draining.

A request is *queued* from the moment the server accepts it until its first token arrives
(or it ends): the requests the engine has not started serving. A new request is refused
with 429 when the queue holds ``max_waiting`` requests, or when the wait it would see (the
queued requests the scheduler will serve before it, aging included, over the measured drain
rate) exceeds its tier's ``max_queue_wait_ms``: better an early, explicit "retry later" than
accepted work that misses its SLA. With ``max_waiting_per_tenant`` a tenant (other than
``default``) with that many requests queued gets 429 ``tenant_queue_full``, so one noisy
tenant cannot fill the queue in front of every other tenant. ``Retry-After`` is the time the
queue needs to drain enough at the measured rate.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from iterserve.config import SchedulerConfig
from iterserve.engine.policy import aged_priority
from iterserve.server.protocol import APIError
from iterserve.server.tenants import DEFAULT_TENANT

# Requests leaving the queue within this window give the drain rate.
DRAIN_WINDOW_S = 30.0
# Most rounds of the expected-wait estimate (each adds the requests that age past the new one,
# and the more urgent arrivals that overtake it, during the wait found by the round before);
# it stops earlier once a round moves it by less than WAIT_ESTIMATE_TOLERANCE_S.
WAIT_ESTIMATE_ROUNDS = 32
WAIT_ESTIMATE_TOLERANCE_S = 1e-3
MAX_RETRY_AFTER_S = 60


class Rejected(APIError):
    """A 429/503 from admission; ``reason`` is the metric label."""

    def __init__(self, status: int, message: str, reason: str, retry_after_s: float) -> None:
        retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after_s)))
        super().__init__(
            status,
            message,
            type="rate_limit_error" if status == 429 else "service_unavailable_error",
            code=reason,
            headers={"Retry-After": str(retry)},
        )
        self.reason = reason


class Admission:
    """Tracks queued requests and the drain rate; decides whether to accept a new one.

    Args:
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.queued: dict[str, int] = {}  # request id -> priority
        self.tenant_of: dict[str, str] = {}  # request id -> tenant, of the queued requests
        self.num_queued_by_tenant: Counter[str] = Counter()  # tenants with none are absent
        self._queued_since: dict[str, float] = {}  # request id -> clock at enqueue
        self.draining = False
        self._left_queue: deque[float] = deque()
        self._accepted: dict[int, deque[float]] = {}  # priority -> clock of each acceptance
        self._started = clock()

    def drain_rate(self) -> float | None:
        """Requests leaving the queue per second over the last window; None if unknown."""
        now = self.clock()
        while self._left_queue and now - self._left_queue[0] > DRAIN_WINDOW_S:
            self._left_queue.popleft()
        if len(self._left_queue) < 2:
            return None
        span = max(now - self._left_queue[0], 1e-3)
        return len(self._left_queue) / span

    def _seconds_for(self, num_requests: int) -> float:
        rate = self.drain_rate()
        return 1.0 if rate is None else num_requests / rate

    def check(
        self,
        config: SchedulerConfig,
        priority: int,
        num_requests: int = 1,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        """Raise :class:`Rejected` when ``num_requests`` new requests of ``priority`` (the
        prompts of one HTTP request) of ``tenant`` must not be accepted.

        Raises:
            Rejected: 503 draining, 429 tenant queue full, queue full or tier wait too long.
            APIError: 400 when ``num_requests`` alone is more than ``max_waiting`` (or
                ``max_waiting_per_tenant``, for a capped tenant).
        """
        cap = config.max_waiting_per_tenant if tenant != DEFAULT_TENANT else None
        for limit, name in ((config.max_waiting, "max_waiting"), (cap, "max_waiting_per_tenant")):
            if limit is not None and num_requests > limit:
                raise APIError(
                    400,
                    f"{num_requests} prompts in one request are more than {name}={limit} can "
                    "ever queue; split the batch",
                    param="prompt",
                )
        if self.draining:
            raise Rejected(
                503, "the server is shutting down; retry on another replica", "shutting_down", 1
            )
        if cap is not None:
            self._check_tenant(tenant, cap, num_requests)
        num_queued = len(self.queued)
        if num_queued + num_requests > config.max_waiting:
            excess = num_queued + num_requests - config.max_waiting
            raise Rejected(
                429,
                f"the queue is full ({num_queued} requests waiting, max_waiting="
                f"{config.max_waiting}); retry later",
                "queue_full",
                self._seconds_for(excess),
            )
        tier = config.tier_for(priority)
        rate = self.drain_rate()
        if tier.max_queue_wait_ms is None or rate is None:
            return
        expected_s = self.expected_wait_s(config, priority, rate)
        limit_s = tier.max_queue_wait_ms / 1000
        if expected_s > limit_s:
            raise Rejected(
                429,
                f"expected queue wait {expected_s * 1000:.0f} ms exceeds the {tier.name!r} "
                f"tier's max_queue_wait_ms={tier.max_queue_wait_ms:g}; retry later",
                "queue_wait",
                expected_s - limit_s,
            )

    def _check_tenant(self, tenant: str, cap: int, num_requests: int) -> None:
        """429 ``tenant_queue_full`` when ``tenant``'s queued requests would pass ``cap``.

        ``Retry-After`` assumes the drain is shared evenly among the tenants with queued
        requests (the scheduler's fair share across tenants): the excess times their number,
        over the measured drain rate.
        """
        num_queued = self.num_queued_by_tenant[tenant]
        if num_queued + num_requests <= cap:
            return
        excess = num_queued + num_requests - cap
        raise Rejected(
            429,
            f"tenant {tenant!r} has {num_queued} requests queued (max_waiting_per_tenant="
            f"{cap}); retry later",
            "tenant_queue_full",
            self._seconds_for(excess * len(self.num_queued_by_tenant)),
        )

    def expected_wait_s(self, config: SchedulerConfig, priority: int, rate: float) -> float:
        """Seconds a new request of ``priority`` would queue: the requests served before it,
        over the drain ``rate`` (requests/s).

        Served before it are (1) the queued requests whose aged priority (the scheduler's
        order: one step per ``aging_interval_s`` waited, ties to the earlier arrival; all of
        them under ``fcfs``) is at least as urgent as its own at the moment it would be
        served, and (2) the requests of more urgent priorities that arrive while it waits and
        it is still less urgent than they are (each priority's measured acceptance rate times
        that time). That moment is the estimate itself, so it is iterated from zero wait.
        Without (1), a lower tier that has waited long enough to tie a new premium request
        goes first, and premium work admitted with "nothing ahead" then waited 6-9 s against a
        1 s limit. Without (2), a best-effort request is promised the wait of the queue ahead
        of it, then overtaken by every premium and standard arrival until it ages to their
        level: under overload best-effort work waited 10 s against an 8 s limit, aged to
        premium, and took the seats of new premium requests (docs/reliability.md, "Overload").
        """
        if config.scheduling_policy == "fcfs":
            return len(self.queued) / rate  # every queued request is ahead; none overtakes
        now = self.clock()
        floor = min(t.priority for t in config.tiers)
        waits_by_priority: dict[int, list[float]] = {}  # aged like the floor below it
        for request_id, p in self.queued.items():
            waits_by_priority.setdefault(max(p, floor), []).append(
                now - self._queued_since[request_id]
            )
        for waits in waits_by_priority.values():
            waits.sort()
        interval_s = config.aging_interval_s
        rates = self._acceptance_rates(now)
        # (rate, seconds it can overtake) of each more urgent priority's arrivals
        overtaking = [(r, (priority - q) * interval_s) for q, r in rates.items() if q < priority]
        wait_s = 0.0
        for _ in range(WAIT_ESTIMATE_ROUNDS):
            mine = aged_priority(priority, wait_s, config)
            ahead = 0
            for p, waits in waits_by_priority.items():
                if p <= mine:
                    ahead += len(waits)
                else:  # aged to ``mine`` once waited (wait_s included) >= its steps' time
                    # (the epsilon of policy._aged: exact multiples of the interval count)
                    threshold_s = (p - mine - 1e-9) * interval_s - wait_s
                    ahead += len(waits) - bisect.bisect_left(waits, threshold_s)
            arrivals = sum(r * min(wait_s, horizon) for r, horizon in overtaking)
            estimate = (ahead + arrivals) / rate
            if abs(estimate - wait_s) < WAIT_ESTIMATE_TOLERANCE_S:
                return estimate
            wait_s = estimate
        return wait_s

    def _acceptance_rates(self, now: float) -> dict[int, float]:
        """Requests accepted per second over the last window, by priority (those with any)."""
        span = min(DRAIN_WINDOW_S, max(now - self._started, 1.0))
        rates = {}
        for priority, times in list(self._accepted.items()):
            while times and now - times[0] > DRAIN_WINDOW_S:
                times.popleft()
            if times:
                rates[priority] = len(times) / span
            else:
                del self._accepted[priority]  # bounded by recent acceptances, not by priorities
        return rates

    def enqueue(self, request_id: str, priority: int, tenant: str = DEFAULT_TENANT) -> None:
        now = self.clock()
        self.queued[request_id] = priority
        self._queued_since[request_id] = now
        self._accepted.setdefault(priority, deque()).append(now)
        self.tenant_of[request_id] = tenant
        self.num_queued_by_tenant[tenant] += 1

    def left_queue(self, request_id: str, started: bool = True) -> None:
        """The request got its first token (``started``) or ended before; idempotent."""
        if self.queued.pop(request_id, None) is None:
            return
        del self._queued_since[request_id]
        tenant = self.tenant_of.pop(request_id)
        self.num_queued_by_tenant[tenant] -= 1
        if not self.num_queued_by_tenant[tenant]:
            del self.num_queued_by_tenant[tenant]  # bounded by the queue, not by every tenant
        if started:
            self._left_queue.append(self.clock())
