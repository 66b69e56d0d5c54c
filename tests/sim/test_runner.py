"""The simulated runner under the real engine: batch shapes, predicted time, tokens, EOS."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from sim_profiles import make_profile

from iterserve.config import ConfigError
from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.sim.profile import BatchShape, OutputLengths, ProfileError, load_profile
from iterserve.sim.replica import VirtualClock, build_simulated_engine, parse_output_lengths
from iterserve.sim.runner import draw_output_len
from iterserve.sim.tokenizer import CharTokenizer


def _scheduled(num_computed: int, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=f"r{num_computed}-{num_tokens}",
        token_ids=[5] * num_tokens,
        num_computed_tokens=num_computed,
        block_table=[0],
        sample=True,
        sampling_params=SamplingParams(),
    )


def test_batch_shape_counts_decodes_context_and_attention_pairs() -> None:
    # Two decodes (contexts 10 and 20 after this token), a first chunk of 4 and a chunk of 3
    # after 8 computed tokens: pairs 4*5/2 = 10 and 3*8 + 3*4/2 = 30; two prefill chunks.
    out = SchedulerOutput(
        scheduled=[_scheduled(9, 1), _scheduled(19, 1), _scheduled(0, 4), _scheduled(8, 3)],
        blocks_to_swap_out=[(1, 2), (3, 4)],
    )
    shape = BatchShape.of(out)
    assert shape == BatchShape(
        num_decode_tokens=2,
        num_prefill_tokens=7,
        decode_context_tokens=30,
        prefill_attention_pairs=40.0,
        num_seqs=4,
        num_swapped_blocks=2,
        num_prefill_seqs=2,
    )


def test_forward_seconds_is_the_documented_formula() -> None:
    profile = make_profile(
        per_context_token_s=1e-5, per_attention_pair_s=1e-6, per_prefill_seq_s=3e-3
    )
    shape = BatchShape(2, 7, 30, 40.0, 4, 2, num_prefill_seqs=2)
    swap = 2 * 16 * 1024 / 1e9
    expected = 0.010 + (2 * 0.001 + 7 * 0.0001) + 30 * 1e-5 + 40 * 1e-6 + 2 * 3e-3 + swap
    assert profile.forward_seconds(shape) == pytest.approx(expected)
    # The floor: a small batch costs at least linear_floor_s in its token-proportional part.
    floored = make_profile(linear_floor_s=0.020)
    assert floored.forward_seconds(BatchShape(num_decode_tokens=2)) == pytest.approx(0.030)
    assert floored.forward_seconds(BatchShape(num_decode_tokens=30)) == pytest.approx(0.040)


def _engine(**kwargs: object) -> tuple[object, VirtualClock]:
    clock = VirtualClock()
    engine, _ = build_simulated_engine(make_profile(), dict(kwargs), clock.advance, clock)
    return engine, clock


def test_each_iteration_advances_the_clock_by_the_prediction() -> None:
    engine, clock = _engine()
    engine.add_request("a", list(range(10, 18)), SamplingParams(max_tokens=3, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        times.append(clock.now)
    # Prefill of 8 tokens (10 + 0.8 ms), then two decodes of 11 ms each.
    assert times == pytest.approx([0.0108, 0.0218, 0.0328])
    assert [s.latency_s for s in engine.telemetry] == pytest.approx([0.0108, 0.011, 0.011])


def test_outputs_are_deterministic_and_end_at_the_drawn_eos() -> None:
    def run(seed: int) -> list[list[int]]:
        engine, _ = _engine(seed=seed)
        params = SamplingParams(max_tokens=2000, n=2, temperature=1.0)
        engine.add_request("a", list(range(10, 30)), params)
        outs = []
        while engine.has_unfinished_requests():
            outs = engine.step() or outs
        return [c.token_ids for c in outs[-1].outputs]

    first, again, other = run(0), run(0), run(1)
    assert first == again and first != other
    assert first[0] != first[1]  # the two completions differ
    for tokens in first:
        assert tokens[-1] == CharTokenizer.eos_token_id and 2 not in tokens[:-1]
        assert all(t >= 3 for t in tokens[:-1])  # ordinary ids only


def test_ignore_eos_and_min_tokens() -> None:
    engine, _ = _engine(seed=3)
    lengths = OutputLengths(distribution="constant", median=4, min=4, max=4)
    engine.runner.output_lengths = lengths
    engine.add_request("eos", [10, 11, 12], SamplingParams(max_tokens=50))
    engine.add_request("min", [10, 11, 13], SamplingParams(max_tokens=50, min_tokens=9))
    engine.add_request("ign", [10, 11, 14], SamplingParams(max_tokens=12, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert len(done["eos"].token_ids) == 4 and done["eos"].finish_reason == "stop"
    assert len(done["min"].token_ids) == 9 and done["min"].finish_reason == "stop"
    assert len(done["ign"].token_ids) == 12 and done["ign"].finish_reason == "length"
    assert 2 not in done["ign"].token_ids
    # ~4 characters per token without a tokenizer file; the EOS (special) shows no text.
    assert len(done["ign"].text) == 4 * 12 and len(done["eos"].text) == 4 * 3


def test_output_length_distributions() -> None:
    rng = random.Random(0)
    lognormal = OutputLengths(median=100, sigma=0.5, min=1, max=1000)
    draws = sorted(draw_output_len(lognormal, rng) for _ in range(2001))
    assert 85 <= draws[1000] <= 115  # the median
    uniform = parse_output_lengths("uniform:5:9")
    assert {draw_output_len(uniform, rng) for _ in range(200)} == set(range(5, 10))
    assert draw_output_len(parse_output_lengths("constant:7"), rng) == 7
    assert parse_output_lengths("lognormal:50:0.3:80").max == 80
    for bad in ("gaussian:5", "uniform:9:5", "lognormal:50:-1", "constant:x"):
        with pytest.raises(ConfigError, match="expected constant:N"):
            parse_output_lengths(bad)
    for bad in ("constant:0", "lognormal:-1:0.5", "uniform:0:4"):
        with pytest.raises(ConfigError, match="must be positive"):
            parse_output_lengths(bad)


def test_pool_max_model_len_and_tensor_parallel_degree_come_from_the_profile() -> None:
    engine, _ = _engine()
    assert engine.scheduler.kv.num_blocks == 256 and engine.max_model_len == 2048
    assert engine.config.model.served_model_name == "Test-Model"
    engine, _ = _engine(block_size=32)
    assert engine.scheduler.kv.num_blocks == 128  # the same tokens in bigger blocks
    engine, _ = _engine(kv_cache_memory=1024 * 16 * 10)
    assert engine.scheduler.kv.num_blocks == 10
    with pytest.raises(ConfigError, match="exceeds the profile's maximum"):
        _engine(max_model_len=4096)
    with pytest.raises(ConfigError, match="measured at tensor parallel degree 1"):
        _engine(tensor_parallel_size=4)
    a100 = load_profile("a100x4-llama3-70b")
    clock = VirtualClock()
    engine, _ = build_simulated_engine(a100, {"tensor_parallel_size": 4}, clock.advance, clock)
    assert engine.config.parallel.tensor_parallel_size == 4


def test_unknown_profile_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match="not a built-in"):
        load_profile("no-such-profile")


def test_profiles_and_pools_out_of_bounds_are_refused(tmp_path: Any) -> None:
    data = make_profile().model_dump()
    for section, key, value in [
        ("iteration", "fixed_s", float("inf")),
        ("iteration", "fixed_s", 1e300),
        ("kv_cache", "num_blocks", 10**12),
        ("output_lengths", "sigma", 1000.0),
    ]:
        bad = {**data, section: {**data[section], key: value}}
        path = tmp_path / "p.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ProfileError):
            load_profile(path)
    with pytest.raises(ConfigError, match="blocks is more than"):
        _engine(num_kv_blocks=10**8)
    with pytest.raises(ConfigError, match="blocks is more than"):
        _engine(swap_space=1e6)


def test_wide_lognormal_lengths_do_not_overflow() -> None:
    rng = random.Random(0)
    dist = parse_output_lengths("lognormal:200:10")
    assert all(1 <= draw_output_len(dist, rng) <= 2048 for _ in range(2000))


def test_logprobs_are_made_up_but_well_formed() -> None:
    engine, _ = _engine()
    engine.add_request("a", [10, 11, 12], SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs = engine.step() or outs
    completion = outs[-1].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    for token_id, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        assert lp.token_id == token_id and lp.top[0] == (token_id, lp.logprob)
        assert len(lp.top) == 2 and lp.top[1][1] < lp.logprob
