"""Fair share between tenants within a tier (Virtual Token Counter): counters, their lift, the
admission order, and the property the design asks for: a tenant sending 10x the others' rate
does not raise their p99 queue time beyond a stated bound (fake runner, fake clock)."""

from __future__ import annotations

import random
from typing import Any

import engine_fakes
import pytest
from engine_fakes import FakeClock
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.config import SchedulerConfig
from iterserve.engine import fair_share, policy
from iterserve.engine.fair_share import VirtualTokenCounter
from iterserve.engine.request import Request

DT = 0.01  # seconds per iteration of the simulated engine


class Harness(engine_fakes.Harness):
    clock: FakeClock

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(clock=FakeClock(), max_steps=2000, **kwargs)


def admitted_order(h: Harness) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order: list[str] = []
    seen: set[str] = set()
    for out in h.runner.outputs:
        for s in out.scheduled:
            if s.request_id not in seen:
                seen.add(s.request_id)
                order.append(s.request_id)
    return order


# ----------------------------------------------------------------- the counter


def test_counters_charge_weighted_tokens_and_lift_a_returning_tenant() -> None:
    vtc = VirtualTokenCounter()
    vtc.arrived("a")
    vtc.charge("a", num_prefill_tokens=10, num_output_tokens=5)
    assert vtc.counter("a") == 10 * fair_share.PREFILL_TOKEN_WEIGHT + 5 * (
        fair_share.OUTPUT_TOKEN_WEIGHT
    )
    # b arrives while a waits: lifted to a's counter (no credit for having been away).
    vtc.arrived("b")
    assert vtc.counter("b") == vtc.counter("a") == 20.0
    # A tenant that already waits is not lifted again.
    vtc.charge("a", num_prefill_tokens=30)
    vtc.arrived("b")
    assert vtc.counter("b") == 20.0
    # Nobody waits: a newcomer starts at the counter of the queue that emptied last.
    for _ in range(2):
        vtc.left_waiting("b")
    vtc.left_waiting("a")
    vtc.arrived("c")
    assert vtc.counter("c") == vtc.counter("a") == 50.0
    # A lift never lowers a counter.
    vtc.charge("c", num_output_tokens=100)
    vtc.left_waiting("c")
    vtc.arrived("c")
    assert vtc.counter("c") == 250.0


def test_idle_tenants_are_forgotten_beyond_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fair_share, "MAX_IDLE_TENANTS", 3)
    vtc = VirtualTokenCounter()
    for i in range(10):
        tenant = f"t{i}"
        vtc.arrived(tenant)
        vtc.charge(tenant, num_prefill_tokens=i + 1)
        vtc.left_waiting(tenant)
        vtc.left_engine(tenant)
    assert len(vtc._idle) == 3 and not vtc.counters
    assert list(vtc._idle) == ["t7", "t8", "t9"]  # the most recently active
    # Each newcomer started at the counter of the queue that emptied last (a chain of lifts).
    assert vtc._idle["t9"] == sum(range(1, 11))
    vtc.arrived("t9")  # remembered: its counter comes back
    assert vtc.counter("t9") == 55.0 and "t9" not in vtc._idle


def make_request(request_id: str, tenant: str, arrival: float, priority: int = 1) -> Request:
    request = Request(request_id, [3, 4], engine_fakes.SamplingParams(max_tokens=1))
    request.tenant, request.arrival_time, request.priority = tenant, arrival, priority
    return request


def test_admission_order_is_priority_then_least_service_then_arrival() -> None:
    vtc = VirtualTokenCounter()
    vtc.counters.update({"heavy": 100.0, "light": 5.0})
    waiting = [
        make_request("h1", "heavy", 0.0),
        make_request("h2", "heavy", 0.1),
        make_request("l1", "light", 0.2),
        make_request("urgent", "heavy", 0.3, priority=0),
    ]
    config = SchedulerConfig(aging_interval_s=1000.0)
    order = policy.AdmissionOrder(waiting, 0.5, config, vtc)
    seen = []
    while (r := order.peek()) is not None:
        assert order.peek() is r  # the same candidate until it is taken
        seen.append(r.request_id)
        order.take()
    assert seen == ["urgent", "l1", "h1", "h2"]
    # fcfs: arrival only, whatever the tenants and priorities.
    fcfs = policy.AdmissionOrder(waiting, 0.5, SchedulerConfig(scheduling_policy="fcfs"), vtc)
    seen = []
    while (r := fcfs.peek()) is not None:
        seen.append(r.request_id)
        fcfs.skip()
    assert seen == ["h1", "h2", "l1", "urgent"]


def test_one_iteration_interleaves_tenants_as_they_are_charged() -> None:
    """Ten requests of tenant a queued before two of b: within one iteration's admissions, b
    goes second and fourth, not last, because each admission charges a's counter first."""
    h = Harness(max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=128)
    for i in range(10):
        h.add(f"a{i}", 4, max_tokens=2, tenant="a")
    h.add("b0", 4, max_tokens=2, tenant="b")
    h.add("b1", 4, max_tokens=2, tenant="b")
    h.step()
    assert admitted_order(h) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_equal_service_keeps_arrival_order_and_default_is_one_tenant() -> None:
    h = Harness(max_num_seqs=1, max_num_batched_tokens=64)
    for i in range(4):
        h.add(f"r{i}", 4, max_tokens=1)
    h.run()
    assert admitted_order(h) == ["r0", "r1", "r2", "r3"]


def test_prefix_hits_and_recompute_are_not_charged() -> None:
    h = Harness(
        max_num_seqs=2,
        num_kv_blocks=6,
        enable_prefix_caching=True,
        preemption_mode="recompute",
        max_model_len=24,
    )
    shared = engine_fakes.prompt(8)
    h.add("a", shared, max_tokens=1, tenant="t")
    h.run()
    vtc = h.scheduler.fair_share
    # Gone from the engine: its counter is idle; 8 prompt tokens and one output token.
    assert vtc._idle["t"] == 8 * fair_share.PREFILL_TOKEN_WEIGHT + fair_share.OUTPUT_TOKEN_WEIGHT
    h.add("b", [*shared, 30, 31], max_tokens=1, tenant="u")  # two full blocks hit
    h.run()
    assert vtc._idle["u"] == 2 + fair_share.OUTPUT_TOKEN_WEIGHT
    # Preempted by recompute and recomputed: each token charged once.
    h = Harness(max_num_seqs=2, num_kv_blocks=6, preemption_mode="recompute", max_model_len=24)
    vtc = h.scheduler.fair_share
    h.add("c", 8, max_tokens=12, tenant="v")
    h.add("d", 8, max_tokens=12, tenant="w")
    h.run()
    assert h.scheduler.num_preemptions > 0
    for tenant in ("v", "w"):
        assert vtc._idle[tenant] == 8 + 12 * fair_share.OUTPUT_TOKEN_WEIGHT


# ----------------------------------------------------------------- the property


def poisson_times(rng: random.Random, rate: float, horizon: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < horizon:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def light_p99_queue_s(
    seed: int, noisy_factor: float, policy_name: str, num_light: int, seats: int, out_len: int
) -> float:
    """Simulate tenants ``light-i`` at rate r each and ``noisy`` at ``noisy_factor * r``, r
    being 15% of the engine's capacity (at factor 1 the engine is at 30-60% of capacity, at
    10 at 165-195%: overloaded);
    return the light tenants' p99 queue time (a request still waiting at the end counts
    with its wait so far)."""
    prompt_len = 8
    iterations_per_request = out_len  # the prefill samples the first token
    capacity = seats / (iterations_per_request * DT)  # requests per second
    rate = 0.15 * capacity
    horizon = 60 * iterations_per_request * DT  # 60 request service times
    h = Harness(
        max_num_seqs=seats,
        max_num_batched_tokens=64,
        num_kv_blocks=512,
        max_model_len=64,
        scheduling_policy=policy_name,
        aging_interval_s=1000.0,
    )
    rng = random.Random(seed)
    arrivals = [
        (t, f"light-{i}") for i in range(num_light) for t in poisson_times(rng, rate, horizon)
    ]
    arrivals += [(t, "noisy") for t in poisson_times(rng, rate * noisy_factor, horizon)]
    arrivals.sort()
    light: list[Request] = []
    k = 0
    for step in range(int(horizon / DT)):
        h.clock.now = step * DT
        while k < len(arrivals) and arrivals[k][0] <= h.clock.now:
            t, tenant = arrivals[k]
            request_id = f"{tenant}/{k}"
            h.add(request_id, prompt_len, max_tokens=out_len, tenant=tenant, arrival_time=t)
            if tenant != "noisy":
                light.append(h.request(request_id))
            k += 1
        h.engine.step()  # (integrity checked once, at the end: the queues grow long)
    h.check()
    end = h.clock.now
    waits = sorted(
        (r.first_scheduled_time if r.first_scheduled_time is not None else end) - r.arrival_time
        for r in light
    )
    assert waits, "no light request arrived"
    return waits[min(len(waits) - 1, int(0.99 * len(waits)))]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    num_light=st.integers(1, 3),
    seats=st.integers(2, 6),
    out_len=st.integers(4, 16),
)
def test_a_tenant_at_10x_rate_does_not_raise_the_others_p99_queue_time(
    seed: int, num_light: int, seats: int, out_len: int
) -> None:
    """The bound: the light tenants' p99 queue time with the noisy tenant at 10x is at most
    their p99 with it at 1x plus three request service times (``out_len`` iterations
    each): the time for seats to free when every seat is busy, which VTC cannot avoid (no
    preemption within a tier); the noisy tenant's backlog itself never counts against them.

    The same workload under ``fcfs`` breaks the bound (its light requests queue behind the
    whole noisy backlog), so the property does not hold by accident of the workload."""
    args = (num_light, seats, out_len)
    service_s = out_len * DT
    bound = light_p99_queue_s(seed, 1.0, "priority", *args) + 3 * service_s
    assert light_p99_queue_s(seed, 10.0, "priority", *args) <= bound + 1e-9
    assert light_p99_queue_s(seed, 10.0, "fcfs", *args) > bound
