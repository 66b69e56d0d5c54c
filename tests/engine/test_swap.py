"""Swap preemption with a runner that simulates the device KV cache and the host pool.

The fake runner keeps ``slot -> token id`` for the device pool and for the host pool. Each
iteration it makes the copies of ``blocks_to_swap_out`` (device -> host), then those of
``blocks_to_swap_in`` (host -> device), then writes this iteration's tokens, and finally
checks that every context position of every scheduled request reads its true token. After
every step the harness also checks that each swapped request's host blocks hold its
computed tokens. Sampled tokens depend only on ``(request_id, position)``, so each request's
output is known in advance: a swap may neither lose nor duplicate a token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import engine_fakes
import pytest
from engine_fakes import (
    VOCAB_SIZE,
    RequestSpec,
    Scenario,
    completion,
    expected_output,
    prompt,
    token_for,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.config import SchedulerConfig
from iterserve.engine import policy
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.policy import PreemptionCosts
from iterserve.engine.request import Request, RequestStatus
from iterserve.engine.sampling_params import SamplingParams

# Swapping is cheaper than recomputing (2 * 1024 / 2**20 s < 1/256 s per token), or dearer.
SWAP_CHEAP = PreemptionCosts(
    prefill_seconds_per_token=1 / 256, swap_bytes_per_second=2**20, kv_bytes_per_token=1024
)
SWAP_DEAR = PreemptionCosts(
    prefill_seconds_per_token=1 / 1024, swap_bytes_per_second=2**20, kv_bytes_per_token=1024
)
SWAP_EVEN = PreemptionCosts(  # exactly equal: recompute (swap only when strictly cheaper)
    prefill_seconds_per_token=1 / 512, swap_bytes_per_second=2**20, kv_bytes_per_token=1024
)


class Harness(engine_fakes.Harness):
    """The shared harness with a host pool and swap preemption on a KV-simulating runner.

    Requests arrive at 0.0 (no aging). After every step it also checks that each swapped
    request's host blocks hold its computed tokens, and :meth:`run` ends with both pools free.
    """

    def __init__(
        self,
        num_host_blocks: int = 8,
        preemption_costs: PreemptionCosts | None = None,
        sample: Callable[[str, int], int] = token_for,
        **kwargs: Any,
    ) -> None:
        defaults: dict[str, Any] = {
            "max_model_len": 16,
            "num_kv_blocks": 4,
            "block_size": 2,
            "max_num_seqs": 8,
            "preemption_mode": "swap",
            "swap_space": 1.0,  # validation only: the pool is num_host_blocks
        }
        super().__init__(
            simulate_kv=True,
            sample=sample,
            num_host_blocks=num_host_blocks,
            preemption_costs=preemption_costs,
            clock=lambda: 0.0,
            **(defaults | kwargs),
        )

    def run(self, max_steps: int | None = None) -> dict[str, RequestOutput]:
        finished = super().run(max_steps)
        assert self.kv.pool.num_free_blocks == self.kv.num_blocks
        assert self.kv.num_free_host_blocks == self.kv.num_host_blocks
        return finished


def start_two_and_preempt_b(h: Harness) -> None:
    """4 device blocks of 2 slots: a and b fill them; at step 3 a needs a 3rd block and b
    (admitted last) is preempted."""
    h.add("a", prompt(3), max_tokens=6)
    h.add("b", prompt(3, first=20), max_tokens=6)
    assert h.step() == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert (h.kv.block_ids("a"), h.kv.block_ids("b")) == ([0, 1], [2, 3])
    assert h.step() == [("a", 3, 1, True), ("b", 3, 1, True)]
    assert h.step() == [("a", 4, 1, True)]
    assert h.last_output().preempted_request_ids == ["b"]


# ----------------------------------------------------------------- swap out and in


def test_swap_out_and_in_copy_exact_block_pairs() -> None:
    h = Harness(num_host_blocks=8)
    start_two_and_preempt_b(h)
    # b's 4 computed tokens sit in device blocks 2 and 3: copied to host blocks 0 and 1.
    assert h.last_output().blocks_to_swap_out == [(2, 0), (3, 1)]
    assert h.last_output().blocks_to_swap_in == []
    b = h.request("b")
    assert b.status == RequestStatus.SWAPPED
    assert (b.num_computed_tokens, b.output_token_ids) == (4, expected_output("b", 3, 2))
    assert h.kv.block_ids("b") == []
    assert h.kv.host_block_ids("b") == [0, 1]
    assert h.kv.num_free_host_blocks == 6
    assert h.kv.block_ids("a") == [0, 1, 3]  # a grew into b's freed tail
    assert h.scheduler.num_preemptions_by_mode == {"recompute": 0, "swap": 1}
    # b needs 3 blocks to go on (5 tokens); a holds 3 or 4 until it finishes at step 6.
    for computed in (5, 6, 7):
        assert h.step() == [("a", computed, 1, True)]
        assert h.request("b").status == RequestStatus.SWAPPED
    assert completion(h.finished["a"]) == (expected_output("a", 3, 6), "length")
    assert h.kv.pool.free_block_ids() == [2, 3, 1, 0]  # a's table [0, 1, 3, 2], tail first
    # b comes back into device blocks 2, 3 (its 4 tokens) and 1 (its next token).
    assert h.step() == [("b", 4, 1, True)]
    assert h.last_output().blocks_to_swap_in == [(0, 2), (1, 3)]
    assert h.last_output().blocks_to_swap_out == []
    assert h.kv.block_ids("b") == [2, 3, 1]
    assert h.kv.host_block_ids("b") == []
    assert h.kv.num_free_host_blocks == 8
    out = h.run()
    assert completion(out["b"]) == (expected_output("b", 3, 6), "length")
    # Every position of b was sampled exactly once, across the swap.
    assert h.sampled_positions("b") == [3, 4, 5, 6, 7, 8]
    assert h.scheduler.num_preemptions_by_mode == {"recompute": 0, "swap": 1}


def test_swapped_request_resumes_before_any_new_admission() -> None:
    h = Harness(num_host_blocks=8)
    start_two_and_preempt_b(h)
    assert h.kv.pool.num_free_blocks == 1
    h.add("c", prompt(1, first=9), max_tokens=1)  # fits the free block, but b comes first
    assert h.step() == [("a", 5, 1, True)]
    assert h.request("c").status == RequestStatus.WAITING
    assert h.kv.pool.num_free_blocks == 1
    assert h.step() == [("a", 6, 1, True)]
    assert h.step() == [("a", 7, 1, True)]  # a finishes
    # b is swapped in (keeping its 4 computed tokens), then c is admitted into what is left.
    assert h.step() == [("b", 4, 1, True), ("c", 0, 1, True)]
    assert h.last_output().blocks_to_swap_in == [(0, 2), (1, 3)]
    out = h.run()
    assert completion(out["b"]) == (expected_output("b", 3, 6), "length")
    assert completion(out["c"]) == (expected_output("c", 1, 1), "length")


def test_abort_of_a_swapped_request_frees_its_host_blocks() -> None:
    h = Harness(num_host_blocks=8)
    start_two_and_preempt_b(h)
    assert h.kv.num_free_host_blocks == 6
    (out,) = h.engine.abort_request("b")
    h.check()
    assert completion(out) == (expected_output("b", 3, 2), "abort")
    assert out.finished
    assert h.kv.host_block_ids("b") == []
    assert h.kv.num_free_host_blocks == 8
    assert "b" not in h.scheduler.requests
    assert h.scheduler.swapped == []
    h.step()
    assert h.last_output().finished_request_ids == ["b"]
    out_a = h.run()["a"]
    assert completion(out_a) == (expected_output("a", 3, 6), "length")


# ----------------------------------------------------------------- fallback to recompute


@pytest.mark.parametrize(("num_host_blocks", "mode"), [(0, "recompute"), (1, "recompute")])
def test_host_pool_too_small_falls_back_to_recompute(num_host_blocks: int, mode: str) -> None:
    h = Harness(num_host_blocks=num_host_blocks)
    start_two_and_preempt_b(h)
    b = h.request("b")
    assert (b.status, b.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert h.last_output().blocks_to_swap_out == []
    assert h.kv.num_free_host_blocks == num_host_blocks
    assert h.scheduler.num_preemptions_by_mode == {"recompute": 1, "swap": 0}
    out = h.run()
    assert completion(out["b"]) == (expected_output("b", 3, 6), "length")
    # b recomputed its prompt and first 2 outputs, then sampled position 5 (once).
    assert h.sampled_positions("b") == [3, 4, 5, 6, 7, 8]


def test_host_pool_of_exactly_the_needed_blocks_swaps() -> None:
    h = Harness(num_host_blocks=2)
    start_two_and_preempt_b(h)
    assert h.request("b").status == RequestStatus.SWAPPED
    assert h.last_output().blocks_to_swap_out == [(2, 0), (3, 1)]
    assert h.kv.num_free_host_blocks == 0
    h.run()


@pytest.mark.parametrize(("max_swaps", "second_status"), [(1, "PREEMPTED"), (2, "SWAPPED")])
def test_concurrent_swap_cap_falls_back_to_recompute(
    monkeypatch: pytest.MonkeyPatch, max_swaps: int, second_status: str
) -> None:
    monkeypatch.setattr(policy, "MAX_CONCURRENT_SWAPS", max_swaps)
    h = Harness(num_host_blocks=16, num_kv_blocks=7, block_size=1)
    for request_id in ("x", "y", "z"):
        h.add(request_id, prompt(2, first=len(request_id)), max_tokens=5)
    assert h.step() == [("x", 0, 2, True), ("y", 0, 2, True), ("z", 0, 2, True)]
    # x takes the last block; y needs one: z (newest) is swapped out.
    assert h.step() == [("x", 2, 1, True), ("y", 2, 1, True)]
    assert h.last_output().preempted_request_ids == ["z"]
    assert h.last_output().blocks_to_swap_out == [(4, 0), (5, 1)]
    assert h.request("z").status == RequestStatus.SWAPPED
    # x takes the last block again; y needs one and is itself the victim, with z swapped.
    assert h.step() == [("x", 3, 1, True)]
    assert h.last_output().preempted_request_ids == ["y"]
    assert h.request("y").status == RequestStatus[second_status]
    swaps = 1 if second_status == "PREEMPTED" else 2
    assert h.scheduler.num_preemptions_by_mode == {"recompute": 2 - swaps, "swap": swaps}
    assert len(h.scheduler.swapped) == swaps
    out = h.run()
    for request_id in ("x", "y", "z"):
        assert completion(out[request_id]) == (expected_output(request_id, 2, 5), "length")


# ----------------------------------------------------------------- auto: the cost model


def test_costs_compare_two_copies_with_one_prefill() -> None:
    for tokens in (1, 3, 100):
        assert SWAP_CHEAP.swap_seconds(tokens) == 2 * tokens * 1024 / 2**20
        assert SWAP_CHEAP.recompute_seconds(tokens) == tokens / 256
        assert SWAP_EVEN.swap_seconds(tokens) == SWAP_EVEN.recompute_seconds(tokens)


@pytest.mark.parametrize(
    ("mode", "costs", "can_swap", "expected"),
    [
        ("auto", SWAP_CHEAP, True, "swap"),
        ("auto", SWAP_DEAR, True, "recompute"),
        ("auto", SWAP_EVEN, True, "recompute"),
        ("auto", None, True, "recompute"),  # nothing measured: never guess
        ("auto", SWAP_CHEAP, False, "recompute"),
        ("swap", SWAP_DEAR, True, "swap"),
        ("swap", None, True, "swap"),
        ("swap", SWAP_CHEAP, False, "recompute"),
        ("recompute", SWAP_CHEAP, True, "recompute"),
    ],
)
def test_choose_preemption_mode(
    mode: str, costs: PreemptionCosts | None, can_swap: bool, expected: str
) -> None:
    config = SchedulerConfig(preemption_mode=mode)  # type: ignore[arg-type]
    victim = Request("v", [3, 4, 5], SamplingParams(), arrival_time=0.0)
    victim.num_computed_tokens = 3
    assert policy.choose_preemption_mode(victim, config, costs, can_swap) == expected
    victim.num_computed_tokens = 0  # nothing computed: nothing to swap
    assert policy.choose_preemption_mode(victim, config, costs, can_swap) == "recompute"


@pytest.mark.parametrize(
    ("costs", "status"),
    [
        (SWAP_CHEAP, RequestStatus.SWAPPED),
        (SWAP_DEAR, RequestStatus.PREEMPTED),
        (SWAP_EVEN, RequestStatus.PREEMPTED),
        (None, RequestStatus.PREEMPTED),
    ],
)
def test_auto_mode_in_the_engine_follows_the_cost_model(
    costs: PreemptionCosts | None, status: RequestStatus
) -> None:
    h = Harness(num_host_blocks=8, preemption_costs=costs, preemption_mode="auto")
    start_two_and_preempt_b(h)
    assert h.request("b").status == status
    swapped = status == RequestStatus.SWAPPED
    assert h.last_output().blocks_to_swap_out == ([(2, 0), (3, 1)] if swapped else [])
    assert h.request("b").num_computed_tokens == (4 if swapped else 0)
    out = h.run()
    assert completion(out["b"]) == (expected_output("b", 3, 6), "length")


def test_auto_mode_without_a_host_pool_recomputes() -> None:
    h = Harness(num_host_blocks=0, preemption_costs=SWAP_CHEAP, preemption_mode="auto")
    start_two_and_preempt_b(h)
    assert h.request("b").status == RequestStatus.PREEMPTED
    h.run()


# ----------------------------------------------------------------- anti-thrashing


def hand_built(specs: list[tuple[str, int, list[int]]]) -> list[Request]:
    """Running requests in admission order: (request_id, priority, preempted_at)."""
    running = []
    for admit_seq, (request_id, priority, preempted_at) in enumerate(specs):
        request = Request(request_id, [3], SamplingParams(), arrival_time=0.0, priority=priority)
        request.admit_seq = admit_seq
        request.preempted_at = list(preempted_at)
        running.append(request)
    return running


def victim_of(running: list[Request], iteration: int) -> str:
    return policy.select_victim(running, 0.0, iteration, SchedulerConfig()).request_id


def test_protection_needs_enough_preemptions_within_the_window() -> None:
    window = policy.PROTECT_WINDOW_ITERATIONS
    assert policy.PROTECT_AFTER_PREEMPTIONS == 2
    (r,) = hand_built([("r", 1, [100])])
    assert not policy.is_protected(r, 101)
    r.preempted_at = [100, 110]
    assert policy.is_protected(r, 110)
    assert policy.is_protected(r, 100 + window - 1)
    assert not policy.is_protected(r, 100 + window)  # the first one left the window
    r.preempted_at = [10, 100 + window - 1]
    assert not policy.is_protected(r, 100 + window)


def test_protected_request_is_skipped_for_the_next_candidate() -> None:
    running = hand_built([("p", 0, []), ("s", 1, []), ("b", 2, [50, 60])])
    assert victim_of(running, 70) == "s"  # b would be first by priority
    assert running[2].preempted_at == [50, 60]  # skipping changes nothing
    # Out of the window b is a candidate again.
    assert victim_of(running, 60 + policy.PROTECT_WINDOW_ITERATIONS) == "b"


def test_the_most_urgent_first_admitted_request_is_never_chosen_while_others_exist() -> None:
    running = hand_built([("p", 0, []), ("s", 1, [50, 60]), ("b", 2, [55, 65])])
    # Every other candidate is protected: one of them loses its protection, p keeps running.
    assert victim_of(running, 70) in {"s", "b"}
    (alone,) = hand_built([("p", 0, [68, 69])])
    assert victim_of([alone], 70) == "p"  # alone: it is the only candidate


def test_when_every_candidate_is_protected_the_one_protected_longest_is_chosen() -> None:
    # s was preempted at 10 and 20: protected since iteration 20.
    # b was preempted at 5 and 30: protected since iteration 30.
    running = hand_built([("p", 0, []), ("s", 1, [10, 20]), ("b", 2, [5, 30])])
    chosen = policy.select_victim(running, 0.0, 40, SchedulerConfig())
    assert chosen.request_id == "s"
    assert chosen.preempted_at == []  # its protection is gone
    assert running[2].preempted_at == [5, 30]


def test_anti_thrashing_in_the_engine() -> None:
    """z (best-effort) is preempted twice, then protected: a premium request is preempted
    instead; when z is the only candidate left it loses its protection (no deadlock)."""
    h = Harness(
        num_host_blocks=0,
        num_kv_blocks=7,
        block_size=1,
        max_model_len=64,
        preemption_mode="recompute",
        priority_preemption_margin=0,  # KV preemption's anti-thrashing alone
    )
    arrivals = {
        0: [("x", 3, 12, "premium"), ("w", 3, 17, "standard"), ("z", 1, 6, "best-effort")],
        2: [("f1", 2, 1, "premium")],
        6: [("f2", 2, 3, "premium")],
        7: [("f0", 2, 3, "premium")],
    }
    preempted: dict[int, list[str]] = {}
    for step in range(100):
        for request_id, num_prompt, max_tokens, tier in arrivals.get(step, []):
            h.add(request_id, prompt(num_prompt), max_tokens, priority=tier)
        if step > 7 and not h.engine.has_unfinished_requests():
            break
        if h.step() and h.last_output().preempted_request_ids:
            preempted[h.scheduler.iteration] = h.last_output().preempted_request_ids
        if h.scheduler.iteration == 11:
            # z (running, the least urgent) was preempted at 2 and 7: protected, so f0 went.
            z = h.request("z")
            assert (z.status, z.preempted_at) == (RequestStatus.RUNNING, [2, 7])
    assert preempted == {2: ["z", "w"], 7: ["z"], 11: ["f0"], 12: ["z"]}
    assert set(h.finished) == {"x", "w", "z", "f0", "f1", "f2"}


# ----------------------------------------------------------------- property


MAX_STEPS = 3000


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_kv_blocks = draw(st.integers(max(1, 8 // block_size), 16 // block_size))
    max_model_len = 40
    budget = draw(st.integers(2, 24))
    max_num_seqs = draw(st.integers(2, min(6, budget)))
    threshold = draw(st.one_of(st.just(0), st.integers(1, budget)))
    mode = draw(st.sampled_from(["swap", "swap", "auto"]))
    costs = draw(st.sampled_from([SWAP_CHEAP, SWAP_CHEAP, SWAP_DEAR, None]))
    token = st.integers(0, VOCAB_SIZE - 1)
    stems = draw(st.lists(st.lists(token, min_size=4, max_size=12), min_size=1, max_size=2))
    requests = []
    for i in range(draw(st.integers(3, 8))):
        stem = draw(st.sampled_from(stems))
        prompt_ids = (stem + draw(st.lists(token, max_size=4)))[: num_kv_blocks * block_size // 2]
        requests.append(
            RequestSpec(
                request_id=f"r{i}",
                prompt_token_ids=prompt_ids or [3],
                max_tokens=draw(st.integers(2, 16)),
                arrival_step=draw(st.integers(0, 3)),
                abort_step=draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 25))),
                priority=draw(st.integers(0, 2)),
            )
        )
    return Scenario(
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        num_host_blocks=draw(st.integers(0, 3 * num_kv_blocks)),
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=mode,
        costs=costs,
        requests=requests,
        priority_preemption_margin=draw(st.sampled_from([0, 0, 1, 2])),
    )


def run_scenario(scenario: Scenario) -> set[str]:
    """Run the scenario to the end, checking every step; returns what it exercised:
    ``swapped`` (out to the host pool), ``swapped in`` (back), ``recomputed`` (a recompute
    preemption), ``aborted while swapped``, ``prefix hit`` and ``priority preempted`` (at
    admission, for a more urgent request)."""
    h = Harness(
        num_host_blocks=scenario.num_host_blocks,
        preemption_costs=scenario.costs,
        sample=scenario.sample,
        preemption_mode=scenario.preemption_mode,
        **scenario.engine_kwargs(),
    )
    expected = {spec.request_id: scenario.expected(spec)[0] for spec in scenario.requests}
    seen: dict[str, int] = {}
    aborted: set[str] = set()
    swapped_ever = False
    aborted_swapped = False

    def record(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            (c,) = out.outputs
            assert c.token_ids == expected[out.request_id][: len(c.token_ids)], out
            if not out.finished:
                assert len(c.token_ids) == seen.get(out.request_id, 0) + 1, out
            seen[out.request_id] = len(c.token_ids)

    for step in range(MAX_STEPS):
        for spec in scenario.requests:
            if spec.arrival_step == step:
                h.add(
                    spec.request_id,
                    spec.prompt_token_ids,
                    spec.max_tokens,
                    priority=spec.priority,
                )
            if spec.abort_step == step and spec.request_id in h.scheduler.requests:
                aborted_swapped |= h.request(spec.request_id).status == RequestStatus.SWAPPED
                (out,) = h.engine.abort_request(spec.request_id)
                assert out.outputs[0].finish_reason == "abort"
                record([out])
                h.finished[out.request_id] = out
                aborted.add(spec.request_id)
                h.check()
        num_finished = len(h.finished)
        finished_before = set(h.finished)
        outputs = h.engine.step()
        record(outputs)
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished_before
                h.finished[out.request_id] = out
        assert len(h.finished) >= num_finished
        h.check()
        swapped_ever |= bool(h.scheduler.swapped)
        assert len(h.scheduler.running) <= scenario.max_num_seqs
        if step >= 4 and not h.engine.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"requests left after {MAX_STEPS} steps: {h.scheduler.requests}")

    assert set(h.finished) == {spec.request_id for spec in scenario.requests}
    for spec in scenario.requests:
        c = h.finished[spec.request_id].outputs[0]
        if spec.request_id in aborted:
            assert c.finish_reason == "abort"
            continue
        assert (c.token_ids, c.finish_reason) == scenario.expected(spec)
    assert h.kv.pool.num_free_blocks == h.kv.num_blocks
    assert h.kv.num_free_host_blocks == h.kv.num_host_blocks
    assert not h.scheduler.requests
    assert not h.scheduler.swapped
    exercised = {
        "swapped": swapped_ever,
        "swapped in": any(out.blocks_to_swap_in for out in h.runner.outputs),
        "recomputed": h.scheduler.num_preemptions_by_mode["recompute"] > 0,
        "aborted while swapped": aborted_swapped,
        "prefix hit": h.scheduler.num_prefix_cache_hits > 0,
        "priority preempted": h.scheduler.num_preemptions_by_reason["priority"] > 0,
    }
    return {name for name, happened in exercised.items() if happened}


def test_swap_under_pressure_keeps_invariants_and_exact_outputs() -> None:
    counts: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(scenarios())
    def check(scenario: Scenario) -> None:
        counts.update(run_scenario(scenario))

    check()
    # Counted over the examples (hypothesis draws differently each run): the minimums are a
    # quarter or less of the fewest seen in repeated runs, so only a generator that stops
    # reaching a feature fails. Aborts of swapped requests are too rare here to require
    # (test_abort_of_a_swapped_request_frees_its_host_blocks covers them).
    assert counts["swapped"] >= 30 and counts["swapped in"] >= 30, counts
    assert counts["recomputed"] >= 30 and counts["prefix hit"] >= 20, counts
    # Priority preemption: 4 to 49 in repeated runs since a request admitted in the same
    # iteration is no victim (most of these arrivals come in the first 4 steps).
    assert counts["priority preempted"] >= 1, counts
