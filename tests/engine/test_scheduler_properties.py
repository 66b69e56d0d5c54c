"""Property tests: random configs, arrivals and aborts against a runner that simulates the KV cache.

The fake runner keeps ``slot -> token id`` for the whole pool. Before it "attends" for a
scheduled request, every context position must hold that request's true token in the slot
its block table names, so a block freed while still read, a prefix-cache hit on the wrong
block, or a chunk written to the wrong slot all fail. Sampled tokens depend only on
``(request_id, position)``, so each request's output is known in advance whatever the
schedule: preemption by recompute may neither lose nor duplicate a token.

Each property also counts what its examples exercised (preemption, prefix-cache hits, ...)
and asserts that enough of them did, so a generator that stops reaching a feature fails.
"""

from __future__ import annotations

from collections import Counter

from engine_fakes import Harness, KVSimRunner, RequestSpec, Scenario
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

VOCAB_SIZE = 24  # of the engine and of the sampled tokens (Scenario.sample)
MAX_STEPS = 3000


@st.composite
def scenarios(draw: st.DrawFn, pressure: bool = False, caching: bool | None = None) -> Scenario:
    """Random engine settings and workloads.

    With ``pressure`` the pool holds 8 to 24 tokens and several requests arrive at once, so
    most examples preempt; otherwise pools, arrivals and aborts range widely. ``caching``
    forces prefix caching on or off (None draws it).
    """
    max_model_len = draw(st.sampled_from([16, 40, 40]))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    if pressure:
        num_kv_blocks = draw(st.integers(max(1, 8 // block_size), 24 // block_size))
    else:
        num_kv_blocks = draw(st.integers(1, 40 // block_size + 1))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 40))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 16))
    max_num_seqs = draw(st.integers(1 + pressure, max(1 + pressure, min(6, budget))))
    max_num_seqs = min(max_num_seqs, budget)
    threshold = draw(st.one_of(st.just(0), st.integers(1, budget)))
    if caching is None:
        caching = draw(st.booleans())
    watermark = 0.0 if pressure else draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]))

    token = st.integers(0, VOCAB_SIZE - 1)
    stems = draw(st.lists(st.lists(token, min_size=4, max_size=16), min_size=1, max_size=3))
    num_requests = draw(st.integers(2 + pressure, 7))
    last_arrival = 3 if pressure else 12
    requests = []
    for i in range(num_requests):
        stem = draw(st.sampled_from(stems))
        num_shared = draw(st.one_of(st.just(len(stem)), st.integers(0, len(stem))))
        suffix = draw(st.lists(token, max_size=6))
        prompt = stem[:num_shared] + suffix
        if pressure:
            prompt = prompt[: num_kv_blocks * block_size // 2] or [3]
        abort_step = draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))
        requests.append(
            RequestSpec(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                max_tokens=draw(st.integers(1, 16)),
                arrival_step=draw(st.integers(0, last_arrival)),
                abort_step=None if pressure else abort_step,
            )
        )
    return Scenario(
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold if chunked else 0,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        kv_watermark=watermark,
        requests=requests,
        vocab_size=VOCAB_SIZE,
    )


def build_engine(scenario: Scenario) -> tuple[LLMEngine, KVSimRunner]:
    h = Harness(
        simulate_kv=True,
        strict=True,
        sample=scenario.sample,
        vocab_size=scenario.vocab_size,
        enable_chunked_prefill=scenario.enable_chunked_prefill,
        kv_watermark=scenario.kv_watermark,
        **scenario.engine_kwargs(),
    )
    assert isinstance(h.runner, KVSimRunner)
    return h.engine, h.runner


def record(
    outputs: list[RequestOutput],
    expected: dict[str, list[int]],
    seen: dict[str, int],
    finished: dict[str, RequestOutput],
) -> None:
    """Streamed outputs grow by exactly one expected token per update until finished."""
    for out in outputs:
        assert out.request_id not in finished, f"{out.request_id} reported after finishing"
        (completion,) = out.outputs
        token_ids = completion.token_ids
        assert token_ids == expected[out.request_id][: len(token_ids)], out
        if out.finished:
            finished[out.request_id] = out
        else:
            assert len(token_ids) == seen.get(out.request_id, 0) + 1, out
        seen[out.request_id] = len(token_ids)


def add_arrivals(engine: LLMEngine, scenario: Scenario, step: int) -> dict[str, RequestSpec]:
    """Add the requests arriving at ``step``; those that can never be served must be refused."""
    accepted = {}
    for spec in scenario.requests:
        if spec.arrival_step != step:
            continue
        params = SamplingParams(max_tokens=spec.max_tokens)
        if scenario.is_valid(spec):
            engine.add_request(spec.request_id, spec.prompt_token_ids, params)
            accepted[spec.request_id] = spec
            continue
        try:
            engine.add_request(spec.request_id, spec.prompt_token_ids, params)
        except InvalidRequestError:
            assert spec.request_id not in engine.scheduler.requests
        else:
            raise AssertionError(f"{spec} accepted but can never be served")
    return accepted


def run_scenario(scenario: Scenario) -> set[str]:
    """Run the scenario to the end, checking every step; returns what it exercised:
    ``preempted``, ``prefix hit`` (a request admitted with cached prompt tokens),
    ``resumed from cache`` (a preempted request re-admitted onto cached blocks),
    ``rejected``, ``aborted`` and ``pool too small`` (a request capped by the pool)."""
    engine, runner = build_engine(scenario)
    scheduler = engine.scheduler
    accepted: dict[str, RequestSpec] = {}
    expected = {spec.request_id: scenario.expected(spec)[0] for spec in scenario.requests}
    seen: dict[str, int] = {}
    finished: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    last_arrival = max(spec.arrival_step for spec in scenario.requests)

    for step in range(MAX_STEPS):
        accepted |= add_arrivals(engine, scenario, step)
        for spec in scenario.requests:
            if spec.abort_step == step and spec.request_id in scheduler.requests:
                (out,) = engine.abort_request(spec.request_id)
                assert out.outputs[0].finish_reason == "abort"
                record([out], expected, seen, finished)
                aborted.add(spec.request_id)
                scheduler.check_integrity()

        num_batches = len(runner.outputs)
        record(engine.step(), expected, seen, finished)
        scheduler.check_integrity()
        assert len(scheduler.running) <= scenario.max_num_seqs
        if len(runner.outputs) > num_batches:
            batch = runner.outputs[-1]
            assert batch.num_scheduled_tokens <= scenario.max_num_batched_tokens
            assert not set(batch.preempted_request_ids) & {s.request_id for s in batch.scheduled}
        if step >= last_arrival and not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"requests left after {MAX_STEPS} steps: {scheduler.requests}")

    assert set(finished) == set(accepted)
    for request_id, spec in accepted.items():
        completion = finished[request_id].outputs[0]
        if request_id in aborted:
            assert completion.finish_reason == "abort"
            continue
        assert (completion.token_ids, completion.finish_reason) == scenario.expected(spec)
    # Finished ids reach the runner at most once (that each one does is a unit test).
    assert len(set(runner.reported_finished)) == len(runner.reported_finished)
    assert set(runner.reported_finished) <= set(finished)
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not scheduler.requests

    # Hits counted at first admissions; the scheduler also counts those of re-admissions.
    num_first_hits = sum(o.num_cached_tokens for o in finished.values())
    exercised = {
        "preempted": scheduler.num_preemptions > 0,
        "prefix hit": num_first_hits > 0,
        "resumed from cache": scheduler.num_prefix_cache_hits > num_first_hits,
        "rejected": len(accepted) < len(scenario.requests),
        "aborted": bool(aborted),
        "pool too small": any(
            len(expected[r]) < spec.max_tokens and scenario.expected(spec)[1] == "length"
            for r, spec in accepted.items()
        ),
    }
    return {name for name, happened in exercised.items() if happened}


def run_examples(strategy: st.SearchStrategy[Scenario], max_examples: int) -> Counter[str]:
    """Run :func:`run_scenario` on ``max_examples`` generated scenarios; returns how many
    examples exercised each feature (counted here, not in hypothesis events, to assert on)."""
    counts: Counter[str] = Counter()

    @settings(
        max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(strategy)
    def check(scenario: Scenario) -> None:
        counts.update(run_scenario(scenario))

    check()
    return counts


# The minimum counts asserted below are a quarter or less of the fewest seen in repeated runs
# (hypothesis draws differently each run): a generator that stops reaching a feature fails,
# ordinary variation does not.


def test_random_workloads_keep_invariants_and_exact_outputs() -> None:
    counts = run_examples(scenarios(), max_examples=400)
    for name in ("preempted", "prefix hit", "rejected", "aborted", "pool too small"):
        assert counts[name] >= 4, counts


def test_small_pools_preempt_without_losing_or_duplicating_tokens() -> None:
    counts = run_examples(scenarios(pressure=True), max_examples=300)
    assert counts["preempted"] >= 30, counts


def test_prefix_hits_under_preemption_read_the_right_blocks() -> None:
    counts = run_examples(scenarios(pressure=True, caching=True), max_examples=200)
    assert counts["preempted"] >= 20 and counts["prefix hit"] >= 20, counts
    assert counts["resumed from cache"] >= 10, counts


def test_identical_prompts_share_cached_blocks_under_pressure() -> None:
    """A fixed scenario with full-block prompts, caching and preemption (exercised every run)."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    scenario = Scenario(
        max_model_len=32,
        num_kv_blocks=6,
        block_size=2,
        max_num_batched_tokens=6,
        max_num_seqs=3,
        long_prefill_token_threshold=4,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        kv_watermark=0.0,
        requests=[
            RequestSpec(f"r{i}", prompt, max_tokens=10, arrival_step=i, abort_step=None)
            for i in range(4)
        ],
        vocab_size=VOCAB_SIZE,
    )
    assert run_scenario(scenario) >= {"preempted", "prefix hit", "resumed from cache"}
