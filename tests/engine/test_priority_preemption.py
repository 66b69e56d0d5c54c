"""Priority preemption at admission (docs/engine.md, "Priority preemption at admission"): a waiting
request at least ``priority_preemption_margin`` more urgent than running ones that finds every
seat or KV block taken preempts them (fake runner, fake clock).

Priorities are the default tiers: premium 0, standard 1, best-effort 2. The fake clock stands
still unless a test moves it, so effective priorities are the requests' own until then.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import engine_fakes
import pytest
from engine_fakes import FakeClock, expected_output

from iterserve.config import SchedulerConfig
from iterserve.engine import policy
from iterserve.engine.request import Request, RequestStatus
from iterserve.engine.sampling_params import SamplingParams
from iterserve.server.live_config import VersionedSettings, merge

PREMIUM, STANDARD, BEST_EFFORT = 0, 1, 2


class Harness(engine_fakes.Harness):
    """The shared harness on a fake clock, recompute preemption unless told otherwise."""

    clock: FakeClock

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("preemption_mode", "recompute")
        kwargs.setdefault("aging_interval_s", 1000.0)
        super().__init__(clock=FakeClock(), max_steps=500, **kwargs)

    def sampled(self, request_id: str) -> int:
        """Output tokens of a request so far (finished ones included)."""
        if request_id in self.finished:
            return len(self.finished[request_id].outputs[0].token_ids)
        return self.request(request_id).num_output_tokens

    def steps_until_sampled(self, request_id: str, limit: int) -> int | None:
        """Steps until ``request_id`` has its first token; None if not within ``limit``."""
        for n in range(1, limit + 1):
            self.step()
            if self.sampled(request_id) >= 1:
                return n
        return None

    @property
    def priority_preemptions(self) -> int:
        return self.scheduler.num_preemptions_by_reason["priority"]


def fill_seats(h: Harness, n: int, priority: int = BEST_EFFORT, max_tokens: int = 40) -> None:
    """``n`` requests of ``priority`` admitted and decoding."""
    for i in range(n):
        h.add(f"be{i}", 3, max_tokens=max_tokens, priority=priority)
    h.step()
    h.step()
    assert len(h.scheduler.running) == n and not h.scheduler.waiting


# ----------------------------------------------------------------- seats


@pytest.mark.parametrize("margin", [1, 2])
def test_premium_arrival_preempts_a_best_effort_seat(margin: int) -> None:
    h = Harness(max_num_seqs=4, priority_preemption_margin=margin)
    fill_seats(h, 4)
    h.add("p", 3, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=2) == 1  # admitted and prefilled at once
    assert h.priority_preemptions == 1
    # The victim: the least urgent, most recently admitted one (all equal: the last).
    assert h.status("be3") == RequestStatus.PREEMPTED
    assert [r.request_id for r in h.scheduler.running] == ["be0", "be1", "be2", "p"]
    assert h.scheduler.num_preemptions_by_cause["recompute", "priority"] == 1
    assert h.scheduler.num_preemptions_by_reason["kv"] == 0


def test_the_policy_is_on_by_default_between_adjacent_tiers() -> None:
    assert SchedulerConfig().priority_preemption_margin == 1
    h = Harness(max_num_seqs=2)
    fill_seats(h, 2, priority=STANDARD)
    h.add("p", 3, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=2) == 1
    assert h.priority_preemptions == 1


def test_without_the_policy_the_premium_arrival_waits_for_a_seat() -> None:
    h = Harness(max_num_seqs=4, priority_preemption_margin=0)  # off
    fill_seats(h, 4)
    h.add("p", 3, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=20) is None
    assert h.status("p") == RequestStatus.WAITING
    assert h.scheduler.num_preemptions == 0


def test_preempted_best_effort_request_is_readmitted_and_finishes_with_its_tokens() -> None:
    h = Harness(max_num_seqs=2, priority_preemption_margin=1)
    fill_seats(h, 2, max_tokens=10)
    h.add("p", 3, max_tokens=3, priority=PREMIUM)
    h.run()
    assert h.priority_preemptions == 1
    for request_id, max_tokens in (("be0", 10), ("be1", 10), ("p", 3)):
        tokens, reason = engine_fakes.completion(h.finished[request_id])
        assert (tokens, reason) == (expected_output(request_id, 3, max_tokens), "length")


# ----------------------------------------------------------------- KV blocks


def kv_full_harness(margin: int) -> Harness:
    """Four best-effort requests hold all 8 blocks (2 each, room to decode 15 tokens); seats
    are free. Blocks of 16 tokens."""
    h = Harness(
        simulate_kv=True,
        strict=True,
        num_kv_blocks=8,
        block_size=16,
        max_num_batched_tokens=128,
        priority_preemption_margin=margin,
    )
    for i in range(4):
        h.add(f"be{i}", 17, max_tokens=20, priority=BEST_EFFORT)
    h.step()
    h.step()
    assert len(h.scheduler.running) == 4 and h.kv_free == 0
    return h


def test_premium_arrival_preempts_when_the_kv_pool_is_full() -> None:
    h = kv_full_harness(margin=1)
    h.add("p", 4, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=2) == 1
    assert h.priority_preemptions == 1 and h.scheduler.num_preemptions_by_reason["kv"] == 0
    assert h.status("be3") == RequestStatus.PREEMPTED
    h.run()
    for i in range(4):
        tokens, _ = engine_fakes.completion(h.finished[f"be{i}"])
        assert tokens == expected_output(f"be{i}", 17, 20)


def test_without_the_policy_the_premium_arrival_waits_for_blocks() -> None:
    h = kv_full_harness(margin=0)
    h.add("p", 4, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=10) is None
    assert h.scheduler.num_preemptions == 0


def test_no_preemption_when_the_victims_cannot_free_enough_blocks() -> None:
    h = Harness(
        simulate_kv=True,
        num_kv_blocks=8,
        block_size=16,
        max_num_batched_tokens=128,
        priority_preemption_margin=1,
    )
    h.add("pa", 40, max_tokens=8, priority=PREMIUM)  # 3 blocks
    h.add("pb", 40, max_tokens=8, priority=PREMIUM)  # 3 blocks
    h.add("be", 17, max_tokens=20, priority=BEST_EFFORT)  # 2 blocks
    h.step()
    assert h.kv_free == 0
    # 3 blocks needed; the only victim holds 2: preempting it would not admit the arrival.
    h.add("p", 40, max_tokens=4, priority=PREMIUM)
    for _ in range(3):
        h.step()
        assert h.status("p") == RequestStatus.WAITING
    assert h.scheduler.num_preemptions == 0
    h.run()
    assert h.scheduler.num_preemptions == 0 and len(h.finished) == 4


def test_swapped_victims_do_not_hold_back_more_urgent_arrivals() -> None:
    h = Harness(
        simulate_kv=True,
        num_host_blocks=64,
        preemption_mode="swap",
        swap_space=1.0,  # validation only: the pool is num_host_blocks
        max_num_seqs=3,
        priority_preemption_margin=1,
    )
    fill_seats(h, 3)
    h.add("p0", 3, max_tokens=20, priority=PREMIUM)
    assert h.steps_until_sampled("p0", limit=2) == 1
    assert h.status("be2") == RequestStatus.SWAPPED
    # be2 waits in the swapped queue (no seat); a second premium arrival still goes first.
    h.add("p1", 3, max_tokens=20, priority=PREMIUM)
    assert h.steps_until_sampled("p1", limit=2) == 1
    assert h.status("be1") == RequestStatus.SWAPPED
    assert h.scheduler.num_preemptions_by_cause["swap", "priority"] == 2
    # What the server's metrics are fed: per-iteration counts by reason and mode.
    telemetry = list(h.engine.telemetry)
    assert sum(t.num_priority_preemptions for t in telemetry) == 2
    assert sum(t.num_priority_swap_preemptions for t in telemetry) == 2
    assert sum(t.num_swap_preemptions for t in telemetry) == 2
    h.run()
    for i in range(3):
        tokens, _ = engine_fakes.completion(h.finished[f"be{i}"])
        assert tokens == expected_output(f"be{i}", 3, 40)


def test_a_request_swapped_in_this_iteration_is_no_victim_and_others_are_recomputed() -> None:
    h = Harness(
        simulate_kv=True,
        strict=True,
        num_host_blocks=64,
        preemption_mode="swap",
        swap_space=1.0,
        max_num_seqs=2,
        priority_preemption_margin=1,
    )
    fill_seats(h, 2)
    h.add("p0", 3, max_tokens=1, priority=PREMIUM)
    h.step()  # p0 swaps be1 out, prefills, samples its only token and finishes
    assert "p0" in h.finished and h.status("be1") == RequestStatus.SWAPPED
    h.add("p1", 3, max_tokens=4, priority=PREMIUM)
    # be1 swaps back in; p1 takes the seat of be0, not of be1 (its copies are pending), and
    # be0 is recomputed: a swap-out now could reuse the host blocks be1 just gave back.
    h.step()
    assert h.sampled("p1") == 1
    assert h.status("be1") == RequestStatus.RUNNING and h.status("be0") == RequestStatus.PREEMPTED
    h.run()  # the runner checks every context read
    for i in range(2):
        tokens, _ = engine_fakes.completion(h.finished[f"be{i}"])
        assert tokens == expected_output(f"be{i}", 3, 40)


# ----------------------------------------------------------------- no preemption for nothing
# (a preemption that does not admit the arrival loses the victim's KV for nothing, and the
# arrival then blocks the queue's head with the victim waiting behind it)


def _kv_harness(num_kv_blocks: int, **kwargs: Any) -> Harness:
    return Harness(
        simulate_kv=True,
        strict=True,
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        priority_preemption_margin=1,
        **kwargs,
    )


def test_a_seat_is_not_taken_when_the_arrival_would_not_fit_in_the_blocks_anyway() -> None:
    h = _kv_harness(10, max_num_seqs=2)
    h.add("q", 29, max_tokens=30, priority=PREMIUM)  # 8 of the 10 blocks
    h.add("be", 3, max_tokens=30, priority=BEST_EFFORT)  # 1 block
    h.step()
    h.step()
    h.add("p2", 20, max_tokens=3, priority=PREMIUM)  # 5 blocks: 1 free + be's 1 are not enough
    h.step()
    assert h.priority_preemptions == 0
    assert h.status("be") == RequestStatus.RUNNING
    h.run()
    assert set(h.finished) == {"q", "be", "p2"}


def test_the_arrivals_unowned_prefix_hits_count_in_what_it_needs() -> None:
    h = _kv_harness(12, enable_prefix_caching=True)
    base = engine_fakes.prompt(16, first=5)
    h.add("old", base, max_tokens=1, priority=PREMIUM)
    h.run()  # its 4 full blocks stay cached, owned by nobody (free)
    h.add("q", engine_fakes.prompt(13, first=9), max_tokens=3, priority=PREMIUM)
    h.add("be", engine_fakes.prompt(13, first=11), max_tokens=3, priority=BEST_EFFORT)
    h.step()
    # 4 free blocks: the arrival takes 5 new ones plus its 4 cached hits from them; be's 4 do
    # not make up the difference.
    h.add("p2", [*base, *engine_fakes.prompt(20, first=17)], max_tokens=3, priority=PREMIUM)
    h.step()
    assert h.priority_preemptions == 0
    assert h.status("be") == RequestStatus.RUNNING
    h.run()
    assert h.kv_free == 12


def test_blocks_a_victim_shares_with_another_request_are_not_counted_as_freed() -> None:
    h = _kv_harness(10, enable_prefix_caching=True)
    shared = engine_fakes.prompt(16)  # 4 full blocks
    h.add("p0", [*shared, 9], max_tokens=30, priority=PREMIUM)
    h.step()
    h.step()
    h.add("be", [*shared, 7], max_tokens=30, priority=BEST_EFFORT)  # 4 shared blocks, 1 own
    h.step()
    h.step()
    h.add("p1", engine_fakes.prompt(22, first=20), max_tokens=30, priority=PREMIUM)  # 6 blocks
    h.step()
    assert h.priority_preemptions == 0  # be would free 1 block, not 5
    assert h.status("be") == RequestStatus.RUNNING


def test_max_num_seqs_lowered_live_drains_instead_of_preempting_the_excess() -> None:
    h = Harness(max_num_seqs=8, priority_preemption_margin=1)
    fill_seats(h, 8)
    h.engine.update_scheduler_config(dataclasses.replace(h.scheduler.config, max_num_seqs=2))
    h.step()
    h.add("p", 3, max_tokens=3, priority=PREMIUM)
    h.step()
    assert h.priority_preemptions == 0  # 7 over the cap: they finish, none is thrown away
    h.run()
    assert "p" in h.finished and h.priority_preemptions <= 1


# ----------------------------------------------------------------- margin


@pytest.mark.parametrize("priority", [PREMIUM, STANDARD, BEST_EFFORT])
def test_equal_priorities_never_preempt_each_other(priority: int) -> None:
    h = Harness(max_num_seqs=3, priority_preemption_margin=1)
    fill_seats(h, 3, priority=priority)
    h.add("new", 3, max_tokens=4, priority=priority)
    assert h.steps_until_sampled("new", limit=10) is None
    assert h.scheduler.num_preemptions == 0


@pytest.mark.parametrize(
    ("waiting", "running"), [(STANDARD, STANDARD), (BEST_EFFORT, STANDARD), (BEST_EFFORT, 5)]
)
def test_aging_earns_a_place_in_the_queue_not_a_running_seat(waiting: int, running: int) -> None:
    # Aged to premium, a waiting request still counts as its tier for priority preemption: it
    # takes the next free seat, never one of its own tier or a more urgent one (priority 5
    # maps to best-effort, the tier it counts as).
    h = Harness(max_num_seqs=2, priority_preemption_margin=1, aging_interval_s=1.0)
    fill_seats(h, 2, priority=running)
    h.add("aged", 3, max_tokens=4, priority=waiting)
    h.clock.now += 10.0
    assert policy.effective_priority(h.request("aged"), h.clock.now, h.scheduler.config) == 0
    assert h.steps_until_sampled("aged", limit=10) is None
    assert h.scheduler.num_preemptions == 0


def test_a_priority_beyond_the_most_urgent_tier_counts_as_that_tier() -> None:
    h = Harness(max_num_seqs=2, priority_preemption_margin=1)
    fill_seats(h, 2, priority=PREMIUM)
    h.add("eager", 3, max_tokens=4, priority=-(2**53 - 1))  # the most urgent a request may be
    assert h.steps_until_sampled("eager", limit=10) is None
    assert h.scheduler.num_preemptions == 0


@pytest.mark.parametrize(
    ("arrival", "margin", "preempts"),
    [
        (STANDARD, 1, True),  # 2 - 1 = 1 >= 1
        (STANDARD, 2, False),  # 1 < 2
        (PREMIUM, 2, True),  # 2 - 0 = 2 >= 2
        (PREMIUM, 3, False),  # 2 < 3
    ],
)
def test_margin_is_respected(arrival: int, margin: int, preempts: bool) -> None:
    h = Harness(max_num_seqs=2, priority_preemption_margin=margin)
    fill_seats(h, 2)
    h.add("new", 3, max_tokens=4, priority=arrival)
    steps = h.steps_until_sampled("new", limit=10)
    assert (steps == 1) == preempts and (steps is None) == (not preempts)
    assert h.priority_preemptions == int(preempts)


def test_less_urgent_arrivals_never_preempt() -> None:
    h = Harness(max_num_seqs=2, priority_preemption_margin=1)
    fill_seats(h, 2, priority=PREMIUM)
    h.add("be", 3, max_tokens=4, priority=BEST_EFFORT)
    assert h.steps_until_sampled("be", limit=10) is None
    assert h.scheduler.num_preemptions == 0


# ----------------------------------------------------------------- aging and anti-thrash


def test_aging_bounds_how_long_best_effort_work_is_held_off_by_a_premium_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Aging alone, without the anti-thrash protection's help.
    monkeypatch.setattr(policy, "PROTECT_AFTER_PREEMPTIONS", 10**6)
    interval = 1.0
    h = Harness(max_num_seqs=2, priority_preemption_margin=1, aging_interval_s=interval)
    h.add("be", 3, max_tokens=10, priority=BEST_EFFORT)
    # One premium request per 0.1 s, each holding a seat for 4 iterations: more premium work
    # than two seats serve, for good.
    finished_at = None
    for n in range(200):
        h.add(f"p{n}", 3, max_tokens=4, priority=PREMIUM)
        h.step()
        h.clock.now += 0.1
        if "be" in h.finished:
            finished_at = h.clock.now
            break
    assert finished_at is not None, "the best-effort request starved"
    assert h.finished["be"].outputs[0].token_ids == expected_output("be", 3, 10)
    # Preempted while still less urgent; once aged to premium (2 intervals) it is no victim,
    # heads the queue by arrival, and takes the next free seat (4 iterations) to decode 10.
    assert h.priority_preemptions >= 1
    assert finished_at <= 2 * interval + (4 + 10 + 2) * 0.1


def test_seats_of_aged_best_effort_work_still_yield_to_a_premium_arrival() -> None:
    # Overload: everything running waited long enough in the queue to age to premium.
    h = Harness(max_num_seqs=2, priority_preemption_margin=1, aging_interval_s=1.0)
    for i in range(2):
        h.add(f"be{i}", 3, max_tokens=40, priority=BEST_EFFORT)
    h.clock.now += 10.0
    h.step()
    assert all(h.status(f"be{i}") == RequestStatus.RUNNING for i in range(2))
    h.add("p", 3, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=2) == 1
    assert h.priority_preemptions == 1
    victim = h.request("be1")  # the most recently admitted
    assert victim.num_priority_preemptions == 1
    # It queues again as if it arrived now (best-effort, not aged): a premium arrival behind
    # it gets the next seat first.
    h.add("p1", 3, max_tokens=4, priority=PREMIUM)
    while h.status("p1") != RequestStatus.RUNNING:
        h.step()
        assert h.status("be1") == RequestStatus.PREEMPTED
    # Aged to premium again (2 intervals after its preemption), it heads the queue by its
    # queue time and takes the next seat; given up its seat once and aged, it is no victim
    # for the next premium arrival, which takes be0's seat (be0's first preemption).
    h.clock.now += 2.0
    while h.status("be1") != RequestStatus.RUNNING:
        h.step()
    h.add("p3", 3, max_tokens=4, priority=PREMIUM)
    h.step()
    assert h.priority_preemptions == 2
    assert h.request("be0").num_priority_preemptions == 1
    assert h.request("be1").num_priority_preemptions == 1
    h.run()
    for i in range(2):
        assert h.finished[f"be{i}"].outputs[0].token_ids == expected_output(f"be{i}", 3, 40)


def test_a_request_admitted_in_this_iteration_is_no_victim_in_it() -> None:
    # The aged best-effort request heads the queue (by arrival) and takes the free seat; the
    # premium arrival behind it in the same iteration must not take that seat back. It once
    # did, and the victim vanished: re-queued, then dropped with the iteration's admissions.
    h = Harness(max_num_seqs=2, priority_preemption_margin=1, aging_interval_s=1.0)
    h.add("p0", 3, max_tokens=40, priority=PREMIUM)
    h.step()
    h.add("be", 3, max_tokens=4, priority=BEST_EFFORT, arrival_time=h.clock.now)
    h.clock.now += 10.0  # be aged to premium
    h.add("p", 3, max_tokens=4, priority=PREMIUM)
    h.step()
    h.check()
    assert h.status("be") == RequestStatus.RUNNING and h.status("p") == RequestStatus.WAITING
    assert h.priority_preemptions == 0
    h.run()
    assert h.finished["be"].outputs[0].token_ids == expected_output("be", 3, 4)


@pytest.mark.parametrize("seed", range(4))
def test_aged_overload_keeps_every_request_and_its_exact_tokens(seed: int) -> None:
    """Random arrivals of every tier above what the seats serve, a clock that ages them,
    aborts: every step keeps the queue invariants, and each request ends with its tokens."""
    rng = random.Random(seed)
    h = Harness(
        max_num_seqs=rng.choice([2, 4]),
        priority_preemption_margin=rng.choice([1, 2]),
        aging_interval_s=rng.choice([0.1, 0.5]),
        preemption_mode=rng.choice(["recompute", "auto"]),
        num_host_blocks=16,
        num_kv_blocks=rng.choice([24, 64]),
        enable_prefix_caching=rng.choice([True, False]),
        max_num_batched_tokens=rng.choice([8, 32]),
    )
    specs: dict[str, tuple[int, int]] = {}
    aborted: set[str] = set()
    for step in range(2000):
        if step < 120:
            for _ in range(rng.choice([0, 1, 1, 2])):
                rid = f"r{len(specs)}"
                specs[rid] = (rng.randint(1, 16), rng.randint(1, 24))
                h.add(rid, specs[rid][0], max_tokens=specs[rid][1], priority=rng.randint(0, 2))
            if rng.random() < 0.05:
                rid = rng.choice(list(specs))
                if rid in h.scheduler.requests:
                    h.finished[rid] = h.engine.abort_request(rid)[0]
                    aborted.add(rid)
        h.step()
        h.check()
        h.clock.now += 0.05
        if step >= 120 and not h.engine.has_unfinished_requests():
            break
    assert not h.scheduler.requests, "requests left"
    assert h.priority_preemptions > 0
    assert set(h.finished) == set(specs)
    for rid, (num_prompt, max_tokens) in specs.items():
        if rid not in aborted:
            tokens = h.finished[rid].outputs[0].token_ids
            assert tokens == expected_output(rid, num_prompt, max_tokens), rid


def test_a_protected_request_stays_protected_from_priority_preemption() -> None:
    h = Harness(max_num_seqs=1, priority_preemption_margin=1)
    h.add("be", 3, max_tokens=60, priority=BEST_EFFORT)
    h.step()
    for n in range(policy.PROTECT_AFTER_PREEMPTIONS):
        h.add(f"p{n}", 3, max_tokens=1, priority=PREMIUM)
        h.step()  # p{n} preempts be, prefills, samples its only token and finishes
        assert f"p{n}" in h.finished and h.status("be") == RequestStatus.PREEMPTED
        h.step()  # be is back
        assert h.status("be") == RequestStatus.RUNNING
    assert policy.is_protected(h.request("be"), h.scheduler.iteration + 1)
    h.add("late", 3, max_tokens=1, priority=PREMIUM)
    for _ in range(5):
        h.step()
        assert h.status("be") == RequestStatus.RUNNING
        assert h.status("late") == RequestStatus.WAITING
    assert h.priority_preemptions == policy.PROTECT_AFTER_PREEMPTIONS


# ----------------------------------------------------------------- the live setting


def test_the_live_setting_turns_the_policy_on_between_iterations() -> None:
    h = Harness(max_num_seqs=2, priority_preemption_margin=0)
    fill_seats(h, 2)
    h.add("p", 3, max_tokens=4, priority=PREMIUM)
    assert h.steps_until_sampled("p", limit=3) is None
    # What PUT /admin/scheduler_config does: merge, validate, hand the engine the new config.
    current = VersionedSettings(h.scheduler.config, version=1)
    changed = merge(current, {"priority_preemption_margin": 1}, 0, 64)
    assert changed is not None and changed.config.priority_preemption_margin == 1
    h.engine.update_scheduler_config(changed.config)
    assert h.steps_until_sampled("p", limit=2) == 1
    assert h.priority_preemptions == 1


@pytest.mark.parametrize("margin", [-1, 2**53])
def test_the_margin_is_bounded(margin: int) -> None:
    """Not negative, and below 2**53 (what a JSON client represents exactly)."""
    with pytest.raises(ValueError, match=r"priority_preemption_margin must be in \[0, 2\*\*53\)"):
        SchedulerConfig(priority_preemption_margin=margin)


# ----------------------------------------------------------------- the policy alone


def running(request_id: str, priority: int, admit_seq: int, arrival_time: float = 0.0) -> Request:
    request = Request(
        request_id,
        [3, 4],
        SamplingParams(max_tokens=4),
        arrival_time=arrival_time,
        priority=priority,
    )
    request.admit_seq = admit_seq
    return request


def test_priority_victims_order_least_urgent_then_most_recently_admitted() -> None:
    config = SchedulerConfig(priority_preemption_margin=1, aging_interval_s=1000.0)
    candidate = running("c", PREMIUM, 99)
    batch = [
        running("s0", STANDARD, 0),
        running("b1", BEST_EFFORT, 1),
        running("p2", PREMIUM, 2),
        running("b3", BEST_EFFORT, 3),
        running("s4", STANDARD, 4),
    ]
    victims = policy.priority_victims(candidate, batch, 0.0, 10, config)
    assert [v.request_id for v in victims] == ["b3", "b1", "s4", "s0"]
    config2 = SchedulerConfig(priority_preemption_margin=2, aging_interval_s=1000.0)
    assert [v.request_id for v in policy.priority_victims(candidate, batch, 0.0, 10, config2)] == [
        "b3",
        "b1",
    ]


def test_priority_victims_none_when_off_fcfs_aged_after_a_preemption_or_protected() -> None:
    candidate = running("c", PREMIUM, 99, arrival_time=10.0)
    victim = running("b", BEST_EFFORT, 0, arrival_time=0.0)
    on = SchedulerConfig(priority_preemption_margin=1, aging_interval_s=1000.0)
    assert policy.priority_victims(candidate, [victim], 10.0, 10, on) == [victim]
    off = SchedulerConfig(priority_preemption_margin=0, aging_interval_s=1000.0)
    assert policy.priority_victims(candidate, [victim], 10.0, 10, off) == []
    fcfs = SchedulerConfig(priority_preemption_margin=1, scheduling_policy="fcfs")
    assert policy.priority_victims(candidate, [victim], 10.0, 10, fcfs) == []
    # Waiting since 0 with 5 s intervals: aged to premium by t=10. It has not given up its
    # seat for priority yet, so its tier counts: a victim (under overload every running
    # request is aged; judging them aged would turn the policy off when it is needed).
    aging = SchedulerConfig(priority_preemption_margin=1, aging_interval_s=5.0)
    assert policy.priority_victims(candidate, [victim], 10.0, 10, aging) == [victim]
    assert policy.victim_priority(victim, 10.0, aging) == BEST_EFFORT
    # Preempted for priority once: from then on aged, so no longer a victim (aging's bound).
    victim.num_priority_preemptions = 1
    assert policy.victim_priority(victim, 10.0, aging) == PREMIUM
    assert policy.priority_victims(candidate, [victim], 10.0, 10, aging) == []
    assert policy.priority_victims(candidate, [victim], 10.0, 10, on) == [victim]  # not aged
    victim.num_priority_preemptions = 0
    victim.preempted_at = [9, 9]  # preempted twice within the window: protected
    assert policy.priority_victims(candidate, [victim], 10.0, 10, on) == []
