"""Small scheduling policies the scheduler calls: queue order with aging and fair share
between tenants, preemption victims with anti-thrashing protection, priority preemption at
admission, and the recompute-vs-swap cost model."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from iterserve.config import SchedulerConfig
from iterserve.engine.fair_share import VirtualTokenCounter
from iterserve.engine.request import Request

# A request preempted this many times within the window is protected from being chosen again.
PROTECT_AFTER_PREEMPTIONS = 2
PROTECT_WINDOW_ITERATIONS = 64
# At most this many requests sit in the host swap pool at once; beyond it, recompute.
MAX_CONCURRENT_SWAPS = 16


def effective_priority(request: Request, now: float, config: SchedulerConfig) -> int:
    """Priority minus one per ``aging_interval_s`` waited since arrival (or since its latest
    preemption for priority: ``Request.queue_order_time``), never below the most urgent tier's
    priority (so an aged request ties the most urgent tier and wins on arrival):
    :func:`aged_priority` of the request at ``now``.

    Under policy ``fcfs`` every request has the same effective priority (0).
    """
    return aged_priority(request.priority, now - request.queue_order_time, config)


def aged_priority(priority: int, waited_s: float, config: SchedulerConfig) -> int:
    """The effective priority of a request of ``priority`` after ``waited_s`` seconds in the
    queue (the scheduler's order; admission estimates waits with it).

    A priority below the most urgent tier counts as that tier (it maps there too), which keeps
    the bound: after ``aging_interval_s * (priority - most urgent)`` a request is ahead of
    every newer arrival. Under policy ``fcfs``: 0 for every request.
    """
    if config.scheduling_policy == "fcfs":
        return 0
    floor = min(t.priority for t in config.tiers)
    return _aged(priority, waited_s, config.aging_interval_s, floor)


def _aged(priority: int, waited_s: float, interval_s: float, floor: int) -> int:
    # The epsilon keeps exact multiples of the interval from rounding down (0.3 / 0.1).
    steps = max(0.0, waited_s) / interval_s + 1e-9
    if steps >= priority - floor:  # aged all the way (also when steps is huge or inf)
        return floor
    return max(floor, priority - math.floor(steps))


def waiting_key(now: float, config: SchedulerConfig) -> Callable[[Request], tuple[int, float, int]]:
    """Sort key of the waiting queue: effective priority, then arrival (then insertion); a
    request preempted for priority counts as arriving at its preemption
    (``Request.queue_order_time``)."""
    if config.scheduling_policy == "fcfs":
        return lambda r: (0, r.queue_order_time, r.arrival_seq)
    floor = min(t.priority for t in config.tiers)  # once per sort, not per request
    interval_s = config.aging_interval_s
    return lambda r: (
        _aged(r.priority, now - r.queue_order_time, interval_s, floor),
        r.queue_order_time,
        r.arrival_seq,
    )


class AdmissionOrder:
    """The waiting queue in admission order, for one ``schedule()`` call: effective
    priority, then the tenant with the least service (:class:`VirtualTokenCounter`), then
    arrival (docs/engine.md, "Fair share between tenants"). The counters are read each time a
    tenant's turn comes up, so a tenant charged for a request admitted in this iteration yields
    to the others within the same iteration.

    Use: :meth:`peek` the next candidate, then :meth:`skip` it (it stays waiting) or
    :meth:`take` it (admitted, or ended); or peek again after making room for it. Without
    ``counters`` (or under policy ``fcfs``) the order is :func:`waiting_key`'s.

    Cost: O(n log n) to build for n waiting requests, O(log t) per step for t tenants.
    """

    def __init__(
        self,
        waiting: Sequence[Request],
        now: float,
        config: SchedulerConfig,
        counters: VirtualTokenCounter | None,
    ) -> None:
        key = waiting_key(now, config)
        self._counters = counters if config.scheduling_policy != "fcfs" else None
        # (effective priority, tenant) -> its requests in arrival order
        self._groups: dict[tuple[int, str], deque[Request]] = {}
        keys = [key(r) for r in waiting]
        by_tenant = self._counters is not None
        groups = self._groups
        for i in sorted(range(len(keys)), key=keys.__getitem__):
            request = waiting[i]
            group = (keys[i][0], request.tenant if by_tenant else "")
            queue = groups.get(group)
            if queue is None:
                queue = groups[group] = deque()
            queue.append(request)
        self._heap = [self._entry(group) for group in self._groups]
        heapq.heapify(self._heap)
        self._current: tuple[int, str] | None = None

    def _entry(self, group: tuple[int, str]) -> tuple[int, float, float, int, str]:
        head = self._groups[group][0]
        service = self._counters.counter(group[1]) if self._counters else 0.0
        return (group[0], service, head.queue_order_time, head.arrival_seq, group[1])

    def peek(self) -> Request | None:
        """The next candidate (the same one until it is skipped or taken); None at the end."""
        if self._current is None:
            if not self._heap:
                return None
            priority, _, _, _, tenant = heapq.heappop(self._heap)
            self._current = (priority, tenant)
        return self._groups[self._current][0]

    def skip(self) -> None:
        """Pass over the current candidate (it keeps waiting)."""
        assert self._current is not None, "peek() first"
        group, self._current = self._current, None
        queue = self._groups[group]
        queue.popleft()
        if queue:
            heapq.heappush(self._heap, self._entry(group))

    def take(self) -> None:
        """The current candidate left the queue: admitted (charge it first, so its tenant's
        next turn reads the new counter) or ended."""
        self.skip()


def is_protected(request: Request, iteration: int) -> bool:
    recent = [i for i in request.preempted_at if iteration - i < PROTECT_WINDOW_ITERATIONS]
    return len(recent) >= PROTECT_AFTER_PREEMPTIONS


def select_victim(
    running: Sequence[Request], now: float, iteration: int, config: SchedulerConfig
) -> Request:
    """The running request to preempt: largest effective priority value, then the most
    recently admitted, skipping protected (thrashing) requests.

    The request that this order would choose last (most urgent, admitted first) is never
    chosen while there is another candidate: protection may move preemption onto other
    requests but never onto it, so it always makes progress (no livelock). If every other
    candidate is protected, the one protected longest loses its protection and is chosen.
    """
    order = sorted(
        running, key=lambda r: (effective_priority(r, now, config), r.admit_seq), reverse=True
    )
    candidates = order[:-1] or order
    for request in candidates:
        if not is_protected(request, iteration):
            return request
    # Protected since its latest preemption: the smallest one has been protected longest.
    oldest = min(candidates, key=lambda r: r.preempted_at[-1])
    oldest.preempted_at.clear()
    return oldest


def priority_victims(
    candidate: Request,
    running: Sequence[Request],
    now: float,
    iteration: int,
    config: SchedulerConfig,
) -> list[Request]:
    """The running requests that ``candidate`` (waiting, not admissible for lack of seats or
    KV blocks) may preempt, in the order to preempt them: least urgent first, then the most
    recently admitted (docs/engine.md, "Priority preemption at admission").

    The candidate counts with its tier's priority (:func:`tier_priority`), not its aged one:
    aging orders the queue (an aged request takes the next free seat ahead of newer arrivals)
    but earns no right to take a seat from running work, so requests of one tier never
    preempt each other however long they waited. A running request counts with its tier's
    priority until it has given up its seat once for a more urgent request, and with its
    effective priority after that (:func:`victim_priority`); it is a victim when that is at
    least ``config.priority_preemption_margin`` steps less urgent than the candidate.
    So aged work is preempted once, not never: under overload every running request has
    waited long enough to be aged, and judging them aged would turn the policy off exactly
    when the urgent tier needs it. And aging's bound still holds: a request preempted once is
    back in the queue with its aged priority, heads it once aged to the most urgent tier (by
    arrival), and is then no victim again. Protected (thrashing) requests are never victims:
    unlike an allocation failure, nothing forces this preemption. Empty when the margin is 0
    (off) or the policy is ``fcfs``.
    """
    margin = config.priority_preemption_margin
    if margin <= 0 or config.scheduling_policy == "fcfs":
        return []
    threshold = tier_priority(candidate.priority, config) + margin
    ranked = [(victim_priority(r, now, config), r.admit_seq, r) for r in running]
    victims = [
        (p, seq, r) for p, seq, r in ranked if p >= threshold and not is_protected(r, iteration)
    ]
    victims.sort(key=lambda v: (v[0], v[1]), reverse=True)
    return [r for _, _, r in victims]


def victim_priority(request: Request, now: float, config: SchedulerConfig) -> int:
    """How urgent a running request counts as a priority-preemption victim: its own priority
    (its tier's) until it has been preempted for priority once, its effective (aged) priority
    after that (:func:`priority_victims`)."""
    if request.num_priority_preemptions == 0:
        return tier_priority(request.priority, config)
    return effective_priority(request, now, config)


def tier_priority(priority: int, config: SchedulerConfig) -> int:
    """The priority of the tier a request's integer ``priority`` maps to (the tier with the
    largest priority <= it, else the most urgent): what priority preemption compares, so a
    client's ``priority: -10**15`` counts as the most urgent tier, not beyond it."""
    return config.tier_for(priority).priority


@dataclass(frozen=True)
class PreemptionCosts:
    """Costs measured by the model runner at start-up (never hard-coded).

    Attributes:
        prefill_seconds_per_token: time to recompute one token's KV in a prefill.
        swap_bytes_per_second: bandwidth of copying KV blocks to the host pool and back.
        kv_bytes_per_token: KV bytes of one token across all layers.
    """

    prefill_seconds_per_token: float
    swap_bytes_per_second: float
    kv_bytes_per_token: int

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_seconds_per_token

    def swap_seconds(self, num_tokens: int) -> float:
        """Out and back in."""
        return 2 * num_tokens * self.kv_bytes_per_token / self.swap_bytes_per_second


def choose_preemption_mode(
    victim: Request,
    config: SchedulerConfig,
    costs: PreemptionCosts | None,
    can_swap: bool,
) -> Literal["recompute", "swap"]:
    """``recompute`` or ``swap`` for one victim.

    ``swap`` mode swaps whenever the host pool and the concurrency cap allow; ``auto`` swaps
    only when copying the victim's KV out and back is cheaper than recomputing it.
    """
    mode = config.preemption_mode
    if mode == "recompute" or not can_swap or victim.num_computed_tokens == 0:
        return "recompute"
    if mode == "swap":
        return "swap"
    if costs is None:
        return "recompute"
    tokens = victim.num_computed_tokens
    return "swap" if costs.swap_seconds(tokens) < costs.recompute_seconds(tokens) else "recompute"
