"""Admission's expected queue wait follows the scheduler's order, aging included (found by
``benchmarks.overload``: at 2x capacity premium requests were admitted with "nothing ahead" and
then waited 6-9 s behind standard and best-effort requests that had aged to premium)."""

from __future__ import annotations

import random

import pytest

from iterserve.config import MAX_AGING_INTERVAL_S, SchedulerConfig, Tier
from iterserve.engine.policy import aged_priority
from iterserve.server.admission import Admission, Rejected

TIERS = (
    Tier("premium", 0, max_queue_wait_ms=1000),
    Tier("standard", 1),
    Tier("best-effort", 2),
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _admission_draining_one_per_s(clock: Clock) -> Admission:
    admission = Admission(clock)
    for i in range(3):  # 3 requests leave over 2 s, then 1 s more: 3 in 3 s
        admission.enqueue(f"d{i}", 1)
        admission.left_queue(f"d{i}")
        clock.now += 1.0
    return admission


def test_requests_aged_to_premium_count_ahead_of_a_new_premium_request() -> None:
    clock = Clock()
    admission = _admission_draining_one_per_s(clock)
    config = SchedulerConfig(tiers=TIERS, aging_interval_s=5.0, max_waiting=100)
    for i in range(3):
        admission.enqueue(f"b{i}", 2)
    admission.check(config, 0)  # fresh best-effort work is behind a new premium request
    clock.now += 10.0  # ... until it has waited two aging steps: it ties premium, and is older
    assert admission.expected_wait_s(config, 0, 1.0) == pytest.approx(3.0)
    with pytest.raises(Rejected) as e:
        admission.check(config, 0)  # 3 ahead at ~1 per s: 3 s > 1 s
    assert e.value.reason == "queue_wait"


def test_requests_that_age_past_it_during_the_wait_count_too() -> None:
    clock = Clock()
    admission = Admission(clock)
    config = SchedulerConfig(tiers=TIERS, aging_interval_s=5.0, max_waiting=100)
    for i in range(2):
        admission.enqueue(f"p{i}", 0)
    for i in range(4):
        admission.enqueue(f"s{i}", 1)
    clock.now += 4.0  # the standard requests are 1 s from aging to premium
    # 2 premium ahead at 1 per s: 2 s, by which time the 4 standard ones tie and are older.
    assert admission.expected_wait_s(config, 0, 1.0) == pytest.approx(6.0)
    assert admission.expected_wait_s(config, 0, 10.0) == pytest.approx(0.2)  # served first


def test_more_urgent_arrivals_overtake_a_lower_tier_until_it_ages() -> None:
    """Found by ``benchmarks.overload`` on the real model: best-effort work promised the wait of
    the queue ahead of it was overtaken by every premium arrival until it aged to premium,
    waited 10 s against an 8 s limit, and then took the seats of new premium requests."""
    clock = Clock()
    admission = Admission(clock)
    tiers = (
        Tier("premium", 0, max_queue_wait_ms=1000),
        Tier("standard", 1),
        Tier("best-effort", 2, max_queue_wait_ms=8000),
    )
    config = SchedulerConfig(tiers=tiers, aging_interval_s=5.0, max_waiting=100)
    for i in range(10):  # premium accepted and served at 1 per s: drain 1 per s
        admission.enqueue(f"p{i}", 0)
        admission.left_queue(f"p{i}")
        clock.now += 1.0
    admission.enqueue("b0", 2)
    admission.enqueue("b1", 2)
    # Two ahead, and premium arriving as fast as the queue drains overtakes it until it has
    # aged two steps (10 s): 2 + 10 requests at 1 per s.
    assert admission.expected_wait_s(config, 2, 1.0) == pytest.approx(12.0, abs=0.01)
    with pytest.raises(Rejected) as e:
        admission.check(config, 2)
    assert e.value.reason == "queue_wait"
    assert admission.expected_wait_s(config, 0, 1.0) == 0.0  # premium: nothing overtakes it
    admission.check(config, 0)
    # Slower premium arrivals (10 in the 30 s window: 1/3 per s) add a geometric series:
    # 2 / (1 - 1/3) = 3 s.
    clock.now += 31.0  # the window forgets the old arrivals
    for i in range(10):
        admission.enqueue(f"q{i}", 0)
        admission.left_queue(f"q{i}")
        clock.now += 1.0
        admission.enqueue(f"d{i}", 2)
        admission.left_queue(f"d{i}")
        clock.now += 1.0
    assert admission.expected_wait_s(config, 2, 1.0) == pytest.approx(3.0, abs=0.01)


def test_fcfs_counts_every_queued_request() -> None:
    clock = Clock()
    admission = Admission(clock)
    config = SchedulerConfig(tiers=TIERS, scheduling_policy="fcfs", max_waiting=100)
    for i in range(3):
        admission.enqueue(f"b{i}", 2)
    assert admission.expected_wait_s(config, 0, 1.0) == pytest.approx(3.0)
    admission.left_queue("b0")
    assert admission.expected_wait_s(config, 0, 1.0) == pytest.approx(2.0)


def test_the_bisected_count_equals_aging_every_queued_request() -> None:
    """``expected_wait_s`` counts the queued requests ahead by bisecting sorted waits; it must
    equal aging each request one by one (the scheduler's rule) at every round."""
    rng = random.Random(7)
    tiers = (Tier("premium", 0), Tier("standard", 1), Tier("best-effort", 2))
    for _ in range(50):
        clock = Clock()
        admission = Admission(clock)
        config = SchedulerConfig(
            tiers=tiers, aging_interval_s=rng.choice([0.5, 1.0, 5.0]), max_waiting=1000
        )
        for i in range(rng.randint(0, 60)):
            admission.enqueue(f"r{i}", rng.choice([-1, 0, 1, 2, 3]))
            clock.now += rng.choice([0.0, 0.5, 0.25, 1.0])  # exact multiples included
        priority, rate = rng.choice([0, 1, 2]), rng.choice([0.5, 2.0, 10.0])

        queued = [(p, clock.now - admission._queued_since[r]) for r, p in admission.queued.items()]
        wait_s = 0.0
        for _ in range(8):  # the estimate's rounds, each request aged one by one
            mine = aged_priority(priority, wait_s, config)
            wait_s = sum(1 for p, w in queued if aged_priority(p, w + wait_s, config) <= mine)
            wait_s /= rate
        # No recent arrivals of other priorities in this window would overtake: compare with
        # the acceptance rates cleared.
        admission._accepted.clear()
        assert admission.expected_wait_s(config, priority, rate) == pytest.approx(wait_s, abs=0.02)


def test_the_wait_estimate_holds_at_the_priority_bounds() -> None:
    # Request priorities are bounded to (-2**53, 2**53) (RequestLimits.resolve_priority): at
    # the bounds the estimate's float arithmetic does not overflow (10**400 did: a 500).
    clock = Clock()
    admission = _admission_draining_one_per_s(clock)
    config = SchedulerConfig(tiers=TIERS, aging_interval_s=MAX_AGING_INTERVAL_S, max_waiting=100)
    bound = 2**53 - 1
    admission.enqueue("low", -bound)
    admission.enqueue("high", bound)
    for priority in (-bound, 0, bound):
        assert admission.expected_wait_s(config, priority, 1.0) >= 0.0
    with pytest.raises(Rejected):  # a 429 (2 queued ahead at 1 per s > 1 s), not an error
        admission.check(config, 0)
