"""Priority tiers, queue order with aging, and preemption victims (fake runner, fake clock).

Time is a :class:`FakeClock` injected as the scheduler's ``clock`` and every request gets an
explicit ``arrival_time``, so effective priorities are exact. Sampled tokens depend only on
``(request_id, position)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import engine_fakes
import pytest
from engine_fakes import FakeClock, token_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.config import SchedulerConfig, Tier
from iterserve.engine import policy
from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.request import Request, RequestStatus
from iterserve.engine.sampling_params import SamplingParams


class Harness(engine_fakes.Harness):
    """The shared harness with preemption by recompute and a fake clock.

    ``add(request_id, n, ...)`` queues an ``n``-token prompt arriving now by the fake clock
    unless ``arrival_time`` is given.
    """

    clock: FakeClock

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("preemption_mode", "recompute")
        super().__init__(clock=FakeClock(), max_steps=500, **kwargs)


def make_request(
    request_id: str, priority: int, arrival_time: float, arrival_seq: int = 0
) -> Request:
    request = Request(
        request_id,
        [3, 4],
        SamplingParams(max_tokens=1),
        arrival_time=arrival_time,
        priority=priority,
    )
    request.arrival_seq = arrival_seq
    return request


CUSTOM_TIERS = (Tier("silver", 20), Tier("bronze", 30), Tier("gold", 10))


# ----------------------------------------------------------------- tiers


@pytest.mark.parametrize(
    ("priority", "tier"),
    [
        (0, "premium"),
        (1, "standard"),
        (2, "best-effort"),
        (3, "best-effort"),
        (100, "best-effort"),
        (-1, "premium"),  # below every tier: the most urgent one
        (-50, "premium"),
    ],
)
def test_integer_maps_to_the_tier_with_the_largest_priority_not_above_it(
    priority: int, tier: str
) -> None:
    assert SchedulerConfig().tier_for(priority).name == tier


@pytest.mark.parametrize(
    ("priority", "tier"),
    [
        (10, "gold"),
        (19, "gold"),
        (20, "silver"),
        (29, "silver"),
        (30, "bronze"),
        (31, "bronze"),
        (9, "gold"),  # below every tier: the most urgent one
        (-7, "gold"),
    ],
)
def test_custom_tiers_in_any_order_map_the_same_way(priority: int, tier: str) -> None:
    assert SchedulerConfig(tiers=CUSTOM_TIERS).tier_for(priority).name == tier


@pytest.mark.parametrize(
    ("priority", "expected"),
    [("premium", 0), ("standard", 1), ("best-effort", 2), (None, 1), (0, 0), (7, 7), (-3, -3)],
)
def test_resolve_priority_accepts_tier_names_integers_and_none(
    priority: int | str | None, expected: int
) -> None:
    engine = Harness().engine
    assert engine.resolve_priority(priority) == expected
    assert SchedulerConfig().tier_for(engine.resolve_priority(None)).name == "standard"


def test_resolve_priority_uses_the_configured_tiers() -> None:
    engine = Harness(tiers=CUSTOM_TIERS).engine
    assert [engine.resolve_priority(n) for n in ("gold", "silver", "bronze")] == [10, 20, 30]
    with pytest.raises(InvalidRequestError) as info:
        engine.resolve_priority("premium")
    assert info.value.param == "priority"


@pytest.mark.parametrize("priority", ["platinum", "Premium", "", "1", True, False, 1.0, 0.5])
def test_bad_priority_is_refused_and_nothing_is_queued(priority: Any) -> None:
    h = Harness()
    with pytest.raises(InvalidRequestError) as info:
        h.engine.resolve_priority(priority)
    assert info.value.param == "priority"
    with pytest.raises(InvalidRequestError) as info:
        h.add("bad", priority=priority)
    assert info.value.param == "priority"
    assert not h.engine.has_unfinished_requests()
    h.add("bad", priority="best-effort")  # the id was not taken
    assert h.request("bad").priority == 2


def test_add_request_stores_the_resolved_priority() -> None:
    h = Harness()
    h.add("p", priority="premium")
    h.add("s")
    h.add("b", priority="best-effort")
    h.add("i", priority=5)
    assert [h.request(r).priority for r in "psbi"] == [0, 1, 2, 5]


# ----------------------------------------------------------------- effective priority


@pytest.mark.parametrize(
    ("priority", "waited", "expected"),
    [
        (2, 0.0, 2),
        (2, 4.999, 2),
        (2, 5.0, 1),
        (2, 9.999, 1),
        (2, 10.0, 0),
        (2, 1000.0, 0),  # floored at the most urgent tier (premium = 0)
        (0, 1000.0, 0),
        (7, 34.0, 1),
        (7, 35.0, 0),
        (-2, 1000.0, 0),  # below every tier: counts as the most urgent tier
        (2, -3.0, 2),  # a clock before the arrival ages nothing
    ],
)
def test_effective_priority_drops_one_per_aging_interval(
    priority: int, waited: float, expected: int
) -> None:
    config = SchedulerConfig(aging_interval_s=5.0)
    request = make_request("r", priority, arrival_time=100.0)
    assert policy.effective_priority(request, 100.0 + waited, config) == expected


def test_effective_priority_floor_is_the_most_urgent_configured_tier() -> None:
    config = SchedulerConfig(tiers=CUSTOM_TIERS, aging_interval_s=1.0)
    request = make_request("r", 30, arrival_time=0.0)
    assert [policy.effective_priority(request, t, config) for t in (0, 1, 19, 20, 21, 500)] == [
        30,
        29,
        11,
        10,
        10,
        10,
    ]


def test_fcfs_gives_every_request_the_same_effective_priority() -> None:
    config = SchedulerConfig(scheduling_policy="fcfs")
    for priority in (-1, 0, 1, 2, 9):
        assert policy.effective_priority(make_request("r", priority, 0.0), 3.0, config) == 0


# ----------------------------------------------------------------- waiting queue order


def add_mixed_queue(h: Harness) -> None:
    """Five requests, each 2 prompt tokens, arriving in this order."""
    h.add("be", 2, priority="best-effort", arrival_time=0.0)
    h.add("std-a", 2, arrival_time=0.5)
    h.add("std-b", 2, priority="standard", arrival_time=1.0)
    h.add("prem-a", 2, priority="premium", arrival_time=2.0)
    h.add("prem-b", 2, priority=0, arrival_time=2.0)  # same arrival: insertion order
    h.add("std-c", 2, priority=1, arrival_time=1.0)


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    h = Harness()
    add_mixed_queue(h)
    h.clock.now = 4.9  # nobody has waited a full aging interval (5 s)
    assert [row[0] for row in h.step()] == ["prem-a", "prem-b", "std-a", "std-b", "std-c", "be"]


def test_fcfs_policy_admits_by_arrival_only() -> None:
    h = Harness(scheduling_policy="fcfs")
    add_mixed_queue(h)
    h.clock.now = 4.9
    assert [row[0] for row in h.step()] == ["be", "std-a", "std-b", "std-c", "prem-a", "prem-b"]


@pytest.mark.parametrize(
    ("now", "order"),
    [
        (8.999, ["std", "prem", "be"]),  # std aged to 0 and arrived before prem; be is at 1
        (9.999, ["std", "prem", "be"]),
        (10.0, ["be", "std", "prem"]),  # be waited 2 intervals: 0, and the oldest
    ],
)
def test_aging_moves_an_old_request_ahead_of_newer_urgent_ones(
    now: float, order: list[str]
) -> None:
    h = Harness()
    h.add("be", 2, priority="best-effort", arrival_time=0.0)
    h.add("std", 2, priority="standard", arrival_time=3.0)
    h.add("prem", 2, priority="premium", arrival_time=8.0)
    h.clock.now = now
    assert [row[0] for row in h.step()] == order


def test_aging_is_measured_by_the_scheduler_clock_at_each_admission() -> None:
    """One slot: admissions happen one at a time, each ordered by the clock at that time."""
    h = Harness(max_num_seqs=1, aging_interval_s=2.0)
    h.add("be", 2, max_tokens=2, priority="best-effort", arrival_time=0.0)
    h.add("p1", 2, max_tokens=2, priority="premium", arrival_time=0.5)
    h.add("p2", 2, max_tokens=2, priority="premium", arrival_time=1.0)
    h.clock.now = 1.0  # be is at 2, p1 and p2 at 0
    assert h.step() == [("p1", 0, 2, True)]
    h.clock.now = 2.0
    assert h.step() == [("p1", 2, 1, True)]  # p1 finishes
    h.clock.now = 3.0  # be waited 3 s: 1; still behind p2
    assert h.step() == [("p2", 0, 2, True)]
    h.clock.now = 4.0
    assert h.step() == [("p2", 2, 1, True)]
    h.add("p3", 2, max_tokens=2, priority="premium", arrival_time=4.0)
    h.clock.now = 4.0  # be waited 4 s: 0, and it arrived before p3
    assert h.step() == [("be", 0, 2, True)]
    h.run()
    assert set(h.finished) == {"be", "p1", "p2", "p3"}


# ----------------------------------------------------------------- preemption victims


def fill_pool_with_be_first(h: Harness) -> None:
    """block_size 1, 10 blocks: be (admitted first), then prem and std fill the pool."""
    h.add("be", 2, max_tokens=10, priority="best-effort", arrival_time=0.0)
    assert h.step() == [("be", 0, 2, True)]
    h.clock.now = 1.0
    h.add("prem", 2, max_tokens=10, priority="premium")
    h.add("std", 2, max_tokens=10, priority="standard")
    assert h.step() == [("be", 2, 1, True), ("prem", 0, 2, True), ("std", 0, 2, True)]
    assert h.step() == [("be", 3, 1, True), ("prem", 2, 1, True), ("std", 2, 1, True)]
    assert h.engine.scheduler.kv.pool.num_free_blocks == 0


def test_victim_is_the_least_urgent_even_when_admitted_first() -> None:
    h = Harness(num_kv_blocks=10, block_size=1, aging_interval_s=5.0)
    fill_pool_with_be_first(h)
    h.clock.now = 4.9  # be has not aged yet: 2 > std's 1
    # be needs a block for position 4; the least urgent request is be itself, not std (admitted
    # last): be gives back its 4 blocks and prem and std grow into them.
    assert h.step() == [("prem", 3, 1, True), ("std", 3, 1, True)]
    assert h.preempted() == ["be"]
    assert h.request("be").status == RequestStatus.PREEMPTED


def test_victim_order_uses_effective_priority() -> None:
    h = Harness(num_kv_blocks=10, block_size=1, aging_interval_s=5.0)
    fill_pool_with_be_first(h)
    h.clock.now = 5.0  # be waited 5 s: effective 1 = std's; std was admitted later
    assert h.step() == [("be", 4, 1, True), ("prem", 3, 1, True)]
    assert h.preempted() == ["std"]
    assert h.request("std").status == RequestStatus.PREEMPTED


def test_equal_priorities_preempt_the_most_recently_admitted_first() -> None:
    h = Harness(num_kv_blocks=7, block_size=1)
    for request_id in ("s1", "s2", "s3"):
        h.add(request_id, 2, max_tokens=5)
    assert h.step() == [("s1", 0, 2, True), ("s2", 0, 2, True), ("s3", 0, 2, True)]
    # s1 takes the last block; s2 needs one: s3 (the newest) is preempted, not s2 itself.
    assert h.step() == [("s1", 2, 1, True), ("s2", 2, 1, True)]
    assert h.preempted() == ["s3"]
    assert h.request("s3").status == RequestStatus.PREEMPTED
    # s1 takes the last block again; s2 needs one: s1 (admitted first) is never chosen.
    assert h.step() == [("s1", 3, 1, True)]
    assert h.preempted() == ["s2"]
    assert [r.request_id for r in h.engine.scheduler.running] == ["s1"]
    out = h.run()
    for request_id in ("s1", "s2", "s3"):
        tokens = out[request_id].outputs[0].token_ids
        assert tokens == [token_for(request_id, p) for p in range(2, 7)]


def test_select_victim_order_on_hand_built_requests() -> None:
    config = SchedulerConfig(aging_interval_s=5.0)
    running = []
    for admit_seq, (request_id, priority) in enumerate(
        [("p0", 0), ("b1", 2), ("s2", 1), ("b3", 2), ("s4", 1), ("p5", 0)]
    ):
        request = make_request(request_id, priority, arrival_time=0.0)
        request.admit_seq = admit_seq
        running.append(request)
    chosen = []
    while len(running) > 1:
        victim = policy.select_victim(running, 0.0, iteration=1000, config=config)
        chosen.append(victim.request_id)
        running.remove(victim)
        victim.preempted_at.clear()
    assert chosen == ["b3", "b1", "s4", "s2", "p5"]


# ----------------------------------------------------------------- aging guarantee (property)


@dataclass(frozen=True)
class QueueCase:
    tiers: tuple[Tier, ...]
    aging_interval_s: float
    t0: float
    others: list[tuple[int, float]]  # (priority, arrival) of every other waiting request
    now: float


QUARTERS = st.integers(0, 80).map(lambda q: q / 4)  # exact binary fractions: no rounding


@st.composite
def queue_cases(draw: st.DrawFn) -> QueueCase:
    premium = draw(st.integers(-3, 3))
    standard = premium + draw(st.integers(1, 3))
    best_effort = standard + draw(st.integers(1, 3))
    tiers = (Tier("premium", premium), Tier("standard", standard), Tier("best-effort", best_effort))
    interval = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 5.0]))
    t0 = draw(QUARTERS)
    tier_priority = st.sampled_from([premium, premium, premium, standard, best_effort])
    others = draw(st.lists(st.tuples(tier_priority, QUARTERS), max_size=12))
    deadline = t0 + interval * (best_effort - premium)
    now = deadline + draw(QUARTERS)
    return QueueCase(tiers, interval, t0, others, now)


@settings(max_examples=300, deadline=None)
@given(queue_cases())
def test_waiting_key_puts_an_aged_request_ahead_of_every_newer_arrival(case: QueueCase) -> None:
    config = SchedulerConfig(tiers=case.tiers, aging_interval_s=case.aging_interval_s)
    best_effort = config.tier_named("best-effort")
    assert best_effort is not None
    old = make_request("old", best_effort.priority, case.t0, arrival_seq=0)
    others = [
        make_request(f"r{i}", priority, arrival, arrival_seq=i + 1)
        for i, (priority, arrival) in enumerate(case.others)
    ]
    order = sorted([*others, old], key=policy.waiting_key(case.now, config))
    ahead_of_old = order[: order.index(old)]
    # Only requests that arrived before t0 may still be ahead (equal arrival: inserted later).
    assert all(r.arrival_time < case.t0 for r in ahead_of_old), (order, case)


def test_the_aging_bound_is_tight() -> None:
    """Just before t0 + interval * (best-effort - premium) a newer premium request still wins."""
    config = SchedulerConfig(aging_interval_s=5.0)
    old = make_request("old", 2, arrival_time=0.0, arrival_seq=0)
    new = make_request("new", 0, arrival_time=1.0, arrival_seq=1)
    key = policy.waiting_key
    assert sorted([old, new], key=key(9.999, config)) == [new, old]
    assert sorted([old, new], key=key(10.0, config)) == [old, new]


@dataclass(frozen=True)
class StreamCase:
    aging_interval_s: float
    dt: float  # clock seconds per engine step
    max_num_seqs: int
    t0_step: int  # the step at which the best-effort request arrives
    # Per step: (priority name, prompt tokens, max_tokens) of the requests arriving then.
    arrivals: list[list[tuple[str, int, int]]]


@st.composite
def stream_cases(draw: st.DrawFn) -> StreamCase:
    num_steps = draw(st.integers(6, 30))
    burst = st.tuples(
        st.sampled_from(["premium", "premium", "premium", "standard"]),
        st.integers(1, 6),
        st.integers(1, 4),
    )
    # At least one premium request per step: sustained higher-priority load.
    arrivals = [
        [
            ("premium", draw(st.integers(1, 6)), draw(st.integers(2, 4))),
            *draw(st.lists(burst, max_size=2)),
        ]
        for _ in range(num_steps)
    ]
    return StreamCase(
        aging_interval_s=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
        dt=draw(st.sampled_from([0.25, 0.5, 1.0])),
        max_num_seqs=draw(st.integers(1, 3)),
        t0_step=draw(st.integers(0, num_steps // 2)),
        arrivals=arrivals,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream_cases())
def test_aged_request_is_admitted_before_newer_arrivals_under_premium_load(
    case: StreamCase,
) -> None:
    h = Harness(
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=16,
        num_kv_blocks=256,
        aging_interval_s=case.aging_interval_s,
        priority_preemption_margin=0,  # the admission order alone, no seat taken back
    )
    t0 = case.t0_step * case.dt
    deadline = t0 + case.aging_interval_s * (2 - 0)  # best-effort - premium
    after_old: set[str] = set()  # requests queued after "old"
    admitted: list[tuple[float, str]] = []
    for step in range(2000):
        h.clock.now = step * case.dt
        if step == case.t0_step:
            h.add("old", 3, 2, priority="best-effort")
        for i, (tier, num_prompt, max_tokens) in enumerate(
            case.arrivals[step] if step < len(case.arrivals) else []
        ):
            request_id = f"{tier}-{step}-{i}"
            h.add(request_id, num_prompt, max_tokens, priority=tier)
            if step >= case.t0_step:
                after_old.add(request_id)  # arrived after "old", or at t0 but queued later
        seen = {rid for _, rid in admitted}
        admitted += [(h.clock.now, row[0]) for row in h.step() if row[0] not in seen]
        if step >= len(case.arrivals) and not h.engine.has_unfinished_requests():
            break
    else:
        raise AssertionError("requests left after 2000 steps")
    order = [rid for _, rid in admitted]
    assert sorted(order) == sorted(h.finished)  # each admitted exactly once (no preemption)
    assert h.engine.scheduler.num_preemptions == 0
    old_index = order.index("old")
    late = [rid for t, rid in admitted if t >= deadline and rid in after_old]
    assert all(order.index(rid) > old_index for rid in late), (old_index, admitted)
